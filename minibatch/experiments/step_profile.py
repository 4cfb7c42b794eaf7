"""Where a step's time goes: ``python -m minibatch profile``.

Real engine steps (the paged policy on a ModelRunner, KV blocks of ``block_size`` tokens), one shape at a time: decode
steps of B requests whose contexts hold ``context_len`` tokens, and prefill steps of one prompt of N tokens. Each shape
is timed without the profiler (the median of ``repeats`` steps: ``step_s``), then profiled with torch's profiler, every
event's self time credited to the component it ran in (``experiments.step_components``):

* projections ``qkv_proj`` / ``o_proj``, ``mlp``, ``norms``, ``embedding``, ``logits`` (the LM head): module forward
  hooks around the model's own modules, found by name (fused decode layers, ``runner.fused_layers``, call none of a
  layer's modules: their C++ ranges are named after these components, the rest of the layer is ``other_ops``);
* ``attention`` (the backend's attend) and ``kv_write`` (its K/V stores: index_copy_ / index_put_ ops inside it);
  ``rotary_and_reshapes``: the rest of the attention module (RoPE, views, transposes);
* ``prepare_inputs`` (the packed batch's tensors and metadata), ``sampling``, ``schedule`` (the scheduler, its Python
  included: it runs no torch ops);
* ``python_overhead``: other time in no torch op at all (the interpreter between ops, hooks, the engine's
  bookkeeping). ``overhead_share`` is it and ``schedule`` over the profiled step.

Each shape is placed on this machine's roofline (``minibatch.roofline``: peak matmul FLOP/s and memory bandwidth,
measured now): FLOPs = 2 x non-embedding parameters x tokens + the LM head's rows + attention's 4 x context x hidden per
token and layer; bytes = every weight once + the K/V read and written. ``bound_s`` = max(FLOPs / peak, bytes /
bandwidth) and ``step_s / bound_s`` says how far the step is from it. Each roof is the best of several measurements, and
a shared host's bandwidth and compute move with its other tenants; so on a CPU ``repeats`` more steps each follow one
matrix product of the peak's (``roofline.peak_probe``) and one sum over memory (``roofline.bandwidth_probe``), and
``step_over_bound_during_steps`` is the median of each such step over the bound at the roofs measured just before it.
The profiler slows the Python-heavy parts most: component times are its view (their shares are what to read),
``step_s`` is not. With ``rounds`` > 1 every shape is profiled that many times (with vLLM: ours and vLLM's in turn) and
its row is the round whose step time is the median.

On a GPU, ``components_s`` is host time (the CPU issuing each op; kernels run asynchronously) and
``device_components_s`` the kernels' own time, credited to the op that launched them; ``device_busy_share`` = device
time / step time. A share far below 1 means the step is launch-bound: the GPU waits for the CPU, which is what CUDA
graphs remove (a step's kernels captured once and replayed with one launch).
"""

from __future__ import annotations

import re
import statistics
import time

import torch

from minibatch.experiments.step_components import breakdown, labelled

CONTEXT_LEN = 256  # --context-len's default (another value was given)


def step_counts(model, num_logits: int, tokens: int, attended: list[int], kv_read_tokens: int,
                kv_bytes_per_token: int) -> tuple[int, int]:
    """(FLOPs, bytes) of one step: ``tokens`` computed, ``num_logits`` rows through the LM head, ``attended``:
    how many keys each new token attends to, ``kv_read_tokens``: K/V token slots read from the cache."""
    cfg = model.config.get_text_config()
    params = sum(p.numel() for p in model.parameters())  # a tied LM head is counted once
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    body = params - embed.numel() - (0 if head is embed else head.numel())  # what every token goes through
    attention = 4 * cfg.hidden_size * cfg.num_hidden_layers * sum(attended)
    flops = 2 * body * tokens + 2 * head.numel() * num_logits + attention
    return flops, params * embed.element_size() + (kv_read_tokens + tokens) * kv_bytes_per_token


def profile_shape(runner, kind: str, size: int, context_len: int, repeats: int, probes=None, block_size=16) -> dict:
    """Time and profile one shape: kind "decode" (``size`` requests with ``context_len`` cached tokens each) or
    "prefill" (one prompt of ``size`` tokens). Returns the shape's row. probes: ``roofline``'s (peak_probe,
    bandwidth_probe) functions, or None; with them, ``repeats`` more steps each after one call of each (``paired``)."""
    from torch.profiler import ProfilerActivity, profile

    from minibatch.clock import WallClock
    from minibatch.experiment import decoding_engine
    from minibatch.machine import native_stderr_hidden
    from minibatch.policies import make_engine
    from minibatch.request import Request, SamplingParams

    n_reqs, max_new, gen = size if kind == "decode" else 1, new_tokens(repeats), torch.Generator().manual_seed(0)
    if kind == "decode":  # every prompt prefilled: the steps from here on are decodes
        engine = decoding_engine(runner, [context_len] * size, max_new, seed=0, block_size=block_size)
    else:
        engine = make_engine("paged", runner, WallClock(runner.device), max_num_seqs=1, block_size=block_size,
                             n_slots=size + max_new + block_size + 64)
    added = []

    def timed_step() -> float:
        if kind == "prefill":  # a new prompt each time: every timed step is its prefill
            added.append(Request(f"p{len(added)}", torch.randint(10, runner.vocab_size, (size,),
                                                                 generator=gen).tolist(), max_new,
                                 SamplingParams(ignore_eos=True)))
            engine.add_request(added[-1])
        t0 = time.perf_counter()
        engine.step()
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if kind == "prefill":
            engine.abort_request(added[-1].request_id)
        return elapsed

    times = [timed_step() for _ in range(repeats + 2)][2:]  # after two warm-ups: first calls allocate, compile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with labelled(runner.model, engine):
        timed_step()  # the hooks' own first call
        with native_stderr_hidden(), profile(activities=activities) as p:
            prof_times = [timed_step() for _ in range(repeats)]
    paired = {"step_s": [], "peak_flop_per_s": [], "bytes_per_s": []}  # each step right after the roofs it then had
    for _ in range(repeats if probes is not None else 0):
        paired["peak_flop_per_s"].append(probes[0]())
        paired["bytes_per_s"].append(probes[1]())
        paired["step_s"].append(timed_step())
    parts, device_parts = breakdown(p.events(), repeats)  # per step: means over the profiled steps
    profiled_s = statistics.mean(prof_times)
    parts["python_overhead"] += max(0.0, profiled_s - sum(parts.values()))  # outside every op and range
    on_gpu = {}
    if runner.device.type == "cuda":  # the GPU's own time: a small busy share means the step is launch-bound
        busy = sum(device_parts.values())
        kernels = round(sum(e.device_type == torch.autograd.DeviceType.CUDA for e in p.events()) / repeats)
        on_gpu = {"device_components_s": {k: round(v, 6) for k, v in device_parts.items() if v},
                  "kernels_per_step": kernels, "device_busy_s": busy, "device_busy_share": round(busy / profiled_s, 3)}
    tokens, attended, kv_read = ((n_reqs, [context_len + 1] * n_reqs, n_reqs * context_len) if kind == "decode"
                                 else (size, list(range(1, size + 1)), 0))
    flops, nbytes = step_counts(runner.model, n_reqs, tokens, attended, kv_read, runner.kv_bytes_per_token)
    return {"kind": kind, "batch": n_reqs, "tokens": tokens, "context_len": context_len if kind == "decode" else 0,
            "step_s": statistics.median(times), "profiled_step_s": profiled_s, "flops": flops, "bytes": nbytes,
            "components_s": {k: round(v, 6) for k, v in parts.items()},
            "overhead_share": round((parts["python_overhead"] + parts["schedule"]) / profiled_s, 3)} | on_gpu | (
        {"paired": paired} if probes is not None else {})


def new_tokens(repeats: int) -> int:
    """Tokens each profiled request generates: its warm-up, timed, profiled and paired steps, with room to spare."""
    return 3 * repeats + 6


def check_lengths(max_model_len: int, model_name: str, decode_batches, prefill_lens, context_len: int,
                  repeats: int, block_size: int = 16) -> None:
    """Raise ValueError (naming the option) unless every profiled request fits the model's context: a decode's
    ``context_len`` or a prefill's length, plus the :func:`new_tokens` it generates, at most ``max_model_len``; and
    a KV block (``block_size`` tokens) no longer than that context."""
    if block_size > max_model_len:
        raise ValueError(f"--block-size {block_size} exceeds {model_name}'s max_model_len {max_model_len} (a block "
                         f"longer than any request); at most {max_model_len}")
    extra = new_tokens(repeats)
    for value, name in ([(context_len, "--context-len")] if decode_batches else []) + [
            (n, "--prefill-lens") for n in prefill_lens]:
        if value + extra > max_model_len:
            raise ValueError(f"{name} {value}: with the {extra} tokens each profiled request generates (3 x --repeats "
                             f"+ 6) it exceeds {model_name}'s max_model_len {max_model_len}; at most "
                             f"{max_model_len - extra}")


def median_round(rounds: list[dict]) -> dict:
    """One shape's rows from several rounds as one row: the round whose step time is the median (the lower of the
    two middle ones for an even count), with every round's ``step_s`` in ``round_step_s`` and all rounds' paired
    probes, so its components still add up to its own profiled step."""
    row = dict(sorted(rounds, key=lambda r: r["step_s"])[(len(rounds) - 1) // 2])
    if "paired" in row:
        row["paired"] = {k: [x for r in rounds for x in r["paired"][k]] for k in row["paired"]}
    return row | {"round_step_s": [r["step_s"] for r in rounds]}


def run_profile(model_name: str = "smollm2-135m", device: str = "cpu", dtype="bfloat16", attention_backend="sdpa",
                decode_batches=(1, 8, 32, 64), prefill_lens=(256, 1024), context_len: int = CONTEXT_LEN,
                repeats: int = 5, threads: int | None = None, vllm_python: str | None = None, block_size: int = 16,
                rounds: int = 1) -> dict:
    """Profile every shape on ``model_name`` (KV blocks of ``block_size`` tokens) and place it on this machine's
    roofline; returns the JSON-ready result (``shapes``: one row per shape, ``roofline``: the measured roofs). With
    ``vllm_python`` (an interpreter with vLLM, its own default block size), every row also gets vLLM's step time for
    its shape (``baselines.vllm_steps``), ``vllm_step_s``. ``rounds`` > 1 runs every shape that many times, ours
    and vLLM's in turn (ours, vLLM, ours, vLLM, ...: a shared host's speed drifts between minutes), each row its
    median round's (:func:`median_round`) and ours against vLLM the median of the rounds' ratios."""
    from minibatch.experiment import load_runner
    from minibatch.precision import dtype_name
    from minibatch.roofline import bandwidth_probe, higher_roofs, measure_device, peak_probe
    from minibatch.report import environment, machine_load
    from minibatch.runner.prepack import PanelLinear

    load_before = machine_load()
    # eager steps: a step replayed from a CUDA graph runs no Python, so its components could not be told apart
    # (benchmarks/cuda_graphs.py times the graphs)
    model, _, runner, _ = load_runner(model_name, device, threads=threads, dtype=dtype,
                                      attention_backend=attention_backend, enforce_eager=True)
    check_lengths(runner.max_model_len, model_name, decode_batches, prefill_lens, context_len, repeats, block_size)
    packed = any(isinstance(m, PanelLinear) for m in model.modules())
    first = measure_device(runner.device, runner.dtype, packed)
    shapes = [("decode", b) for b in decode_batches] + [("prefill", n) for n in prefill_lens]
    on_cpu = runner.device.type == "cpu"
    probes = (peak_probe(runner.dtype, packed_kernel=packed), bandwidth_probe()) if on_cpu else None
    from minibatch.baselines.vllm_steps import add_vllm_steps, vllm_step_times

    per_round, vllm_rounds, peer = [], [], {}
    for _ in range(rounds):
        per_round.append([profile_shape(runner, kind, size, context_len, repeats, probes, block_size)
                          for kind, size in shapes])
        if vllm_python:
            times, peer = vllm_step_times(runner.model, shapes, context_len, repeats, vllm_python)
            vllm_rounds.append(times)
    rows = [median_round(list(r)) for r in zip(*per_round)]
    del probes
    probe_peaks, probe_bws = ([x for r in rows for x in r.get("paired", {}).get(k, [])]  # the same roofs, probed
                              for k in ("peak_flop_per_s", "bytes_per_s"))
    roof = higher_roofs(first, measure_device(runner.device, runner.dtype, packed), "before and after the steps",
                        probe_peaks, probe_bws)
    for (kind, size), row in zip(shapes, rows):
        row["bound_s"] = max(row["flops"] / roof.peak_flop_per_s, row["bytes"] / roof.bytes_per_s)
        row["bound"] = "compute" if row["flops"] * roof.bytes_per_s >= row["bytes"] * roof.peak_flop_per_s else "memory"
        row["step_over_bound"] = round(row["step_s"] / row["bound_s"], 2)
        paired = ""
        if "paired" in row:  # each paired step over the bound at the roofs measured just before it
            steps, peaks, bws = (row["paired"][k] for k in ("step_s", "peak_flop_per_s", "bytes_per_s"))
            row["peak_flop_per_s_during_steps"], row["bytes_per_s_during_steps"] = map(statistics.median, (peaks, bws))
            row["step_over_bound_during_steps"] = round(statistics.median(  # the bound above at each moment's roofs
                s / max(row["flops"] / f, row["bytes"] / b) for s, f, b in zip(steps, peaks, bws)), 2)
            paired = (f" ({row['step_over_bound_during_steps']:.1f}x at the {statistics.median(peaks) / 1e9:.0f} "
                      f"GFLOP/s and {statistics.median(bws) / 1e9:.1f} GB/s measured between steps)")
        top = sorted(row["components_s"].items(), key=lambda kv: -kv[1])[:3]
        print(f"{kind} {size:>5}: step {row['step_s'] * 1e3:7.1f} ms, roofline bound {row['bound_s'] * 1e3:6.1f} ms "
              f"({row['bound']}-bound), {row['step_over_bound']:.1f}x{paired}; "
              f"overhead {row['overhead_share']:.0%}; top: "
              + ", ".join(f"{k} {v / row['profiled_step_s']:.0%}" for k, v in top)
              + (f"; GPU busy {row['device_busy_share']:.0%} of the step, {row['kernels_per_step']} kernels"
                 if "device_busy_s" in row else ""))
    if vllm_python:
        add_vllm_steps(rows, shapes, vllm_rounds)
    return {"environment": environment(load_before), "model": model_name, "dtype": dtype_name(runner.dtype),
            "attention_backend": attention_backend, "fused_decode_layers": runner.fused_decoder is not None,
            "threads": torch.get_num_threads(), "context_len": context_len, "block_size": block_size,
            "repeats": repeats, "rounds": rounds,
            "roofline": {"name": roof.name, "peak_flop_per_s": roof.peak_flop_per_s, "bytes_per_s": roof.bytes_per_s,
                         "source": roof.source},
            "shapes": rows} | ({"vllm": peer} if peer else {})


def add_profile_arguments(p) -> None:
    p.add_argument("--decode-batches", default="1,8,32,64", help="decode steps of this many requests (comma list)")
    p.add_argument("--prefill-lens", default="256,1024", help="prefill steps of one prompt this long (comma list)")
    p.add_argument("--context-len", type=int, default=CONTEXT_LEN, help="cached tokens of every decoding request")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (vLLM's CPU backend: 128)")
    p.add_argument("--repeats", type=int, default=5, help="steps timed (and as many profiled) per shape")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--vllm-python", default=None, help="also time every shape on vLLM, run by this interpreter")
    p.add_argument("--rounds", type=int, default=1, help="profile every shape this many times (with --vllm-python: "
                   "ours and vLLM's in turn); each row is its median round")
    p.add_argument("--json", dest="json_path", default=None, help="write the result here")
    p.add_argument("--figure", default=None, help="save the breakdown figure here (PNG)")


def profile_command(args, command: str) -> dict:
    """``python -m minibatch profile``: check the options, profile, print, write JSON and figure."""
    from minibatch.baselines.vllm_peer import interpreter_problem, lacks_vllm
    from minibatch.checks import MAX_BLOCK_SIZE, check_int, comma_list
    from minibatch.files import check_output_file
    from minibatch.report import write_json

    def sizes(text, name):  # ASCII digits only: int() would take '--5' as a bad literal, '²' not at all
        return tuple(check_int(int(x) if re.fullmatch(r"-?[0-9]+", x) else x, name, 1, 1 << 16)
                     for x in comma_list(text, name))
    batches, prefills = sizes(args.decode_batches, "--decode-batches"), sizes(args.prefill_lens, "--prefill-lens")
    if not batches and not prefills:
        raise ValueError("--decode-batches and --prefill-lens are both empty: nothing to profile")
    if not batches and args.context_len != CONTEXT_LEN:
        raise ValueError("--context-len does not apply with --decode-batches empty (it is the decode steps' context)")
    for value, name, high in ((args.context_len, "--context-len", 1 << 16), (args.block_size, "--block-size",
                              MAX_BLOCK_SIZE), (args.repeats, "--repeats", 1000), (args.rounds, "--rounds", 20)):
        check_int(value, name, 1, high)
    if args.threads is not None:
        check_int(args.threads, "--threads", 1, 1024)
    problem = args.vllm_python is not None and (interpreter_problem(args.vllm_python) or lacks_vllm(args.vllm_python))
    if problem:
        raise ValueError(problem)
    if args.figure is not None and not args.figure.endswith(".png"):  # (a figure is saved as NAME.png)
        raise ValueError(f"--figure must be a .png path, got {args.figure!r}")
    for path, name in ((args.json_path, "--json"), (args.figure, "--figure")):
        if path is not None:
            check_output_file(path, name)
    result = {"command": command} | run_profile(args.model, args.device, args.dtype, args.attention_backend, batches,
                                                prefills, args.context_len, args.repeats, args.threads,
                                                args.vllm_python, args.block_size, args.rounds)
    if args.figure:
        from minibatch.viz.step_profile import plot_profile

        result["figure"] = plot_profile(result, args.figure)
        print(f"wrote {result['figure']}")
    write_json(result, args.json_path)
    return result
