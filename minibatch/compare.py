"""The main job: one trace through every policy, measured the same way.

    python -m minibatch compare [--model smollm2-135m] [--num-requests 32] [--rate 4] ...

Policies: ``static`` and ``orca`` run through our engine; ``hf_generate`` (HF ``generate`` on
padded static batches, the outside baseline) and ``hf_generate_batch`` (transformers' own
continuous batching, the peer) run through transformers. Every policy gets fresh copies of the
same requests, and every greedy policy's outputs are checked token for token against HF
``generate`` run on each request alone (``matches_reference``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from minibatch.engine import Engine
from minibatch.policies import ENGINE_POLICIES, PAGED_POLICIES, SPEC_POLICIES, make_engine
from minibatch.request import Request, SamplingParams

BASELINE_POLICIES = ("hf_generate", "hf_generate_batch")
ARRIVALS = ("poisson", "zero", "gamma")
MAX_NUM_REQUESTS = 1_000_000
MIN_RATE, MAX_RATE = 1e-6, 1e6  # requests/s (below MIN_RATE arrivals pass any sane trace length)
ALL_POLICIES = ENGINE_POLICIES + BASELINE_POLICIES


@dataclass
class CompareConfig:
    """Options of ``python -m minibatch compare`` (see ``--help``); validated on creation."""

    model: str = "smollm2-135m"
    num_requests: int = 32
    rate: float = 4.0  # requests/s (Poisson unless arrival says otherwise)
    arrival: str = "poisson"
    trace: str | None = None  # a saved trace JSON replaces the generated one
    policies: tuple[str, ...] = ALL_POLICIES
    clock: str = "wall"
    device: str = "cpu"  # where the model runs: cpu, cuda or cuda:N
    seed: int = 0
    batch_size: int = 8  # static batching and hf_generate: requests per padded batch
    max_bs: int = 32  # orca: most requests per iteration (Orca's max_bs); KV memory limits it too
    max_wait_s: float = 0.5
    max_prompt_len: int = 256
    max_output_len: int = 256
    output_scale: float = 0.25  # ShareGPT output lengths x this: CPU-sized, same spread
    n_slots: int | None = None  # KV token slots; default batch_size * the longest request (see kv_slots)
    block_size: int = 16  # paged policies' KV block size (orca keeps Orca's per-token slots)
    preemption_mode: str = "recompute"  # paged policies: "recompute" or "swap"
    attention_backend: str = "torch"  # "torch" or "triton" (our packed attention)
    orca_reservation: str = "oracle"  # "oracle": prompt + the trace's output length; "max": prompt + max_output_len
    max_num_batched_tokens: int | None = None  # chunked policies' token budget per step (default 512); others have none
    target_itl_ms: float | None = None  # chunked: adaptive chunk size aiming at this step time
    policy_order: str = "fcfs"  # queue policy of every iteration-level scheduler: fcfs, sjf, priority
    aging_s: float | None = 1.0  # priority: seconds of waiting worth one priority level
    long_prompts: int = 0  # the long-prompt trace: this many requests get long_prompt_len-token prompts
    long_prompt_len: int = 1024
    draft_model: str | None = None  # spec: the draft; default smollm2-135m-draft for smollm2-135m, else the target itself
    num_speculative_tokens: int = 4  # spec policies: k (with adaptive_k: the largest k)
    adaptive_k: bool = False  # spec policies: k per request from its acceptance history
    profile: str | None = None  # a calibrated cost model (python -m minibatch calibrate) for the sim clock
    trace_out: str | None = None  # write a Chrome trace JSON per policy into this folder
    check_reference: bool = True
    slo_ttft_s: float | None = 2.0  # goodput counts requests meeting every SLO given
    slo_tpot_s: float | None = 0.5
    json_path: str | None = None
    figures_dir: str | None = "figures"
    progress: bool = True
    command: str | None = None  # the command line, recorded in the JSON

    def __post_init__(self):
        """Check every field (the CLI and the API share this): one ValueError/TypeError naming the
        field as its CLI option and the allowed range. Explicit bad values are never replaced."""
        from minibatch.checks import (MAX_BLOCK_SIZE, MAX_KV_SLOTS, MAX_NUM_SEQS, MAX_SECONDS, MAX_SPEC_TOKENS,
                                      MAX_TOKENS, FieldTypeError, check_choice, check_device, check_int, check_real)
        from minibatch.models import check_model_name
        from minibatch.scheduler.queue_policy import QUEUE_POLICIES

        def opt(name: str) -> str:
            return "--" + name.replace("_", "-")

        if isinstance(self.policies, str) or not hasattr(self.policies, "__iter__"):
            raise ValueError(f"--policies must be a comma-separated subset of {','.join(ALL_POLICIES)}, got {self.policies!r}")
        self.policies = tuple(self.policies)
        unknown = [p for p in self.policies if p not in ALL_POLICIES]
        if unknown or not self.policies:
            raise ValueError(f"--policies must be a comma-separated subset of {','.join(ALL_POLICIES)}, got {unknown or '(none)'}")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"--policies lists a policy twice: {','.join(self.policies)}")
        ints = {"num_requests": (1, MAX_NUM_REQUESTS), "seed": (0, 2**32 - 1), "batch_size": (1, MAX_NUM_SEQS),
                "max_bs": (1, MAX_NUM_SEQS), "max_prompt_len": (1, MAX_TOKENS), "max_output_len": (1, MAX_TOKENS),
                "block_size": (1, MAX_BLOCK_SIZE), "long_prompts": (0, None), "long_prompt_len": (1, MAX_TOKENS),
                "num_speculative_tokens": (1, MAX_SPEC_TOKENS), "n_slots": (1, MAX_KV_SLOTS),
                "max_num_batched_tokens": (1, MAX_TOKENS)}
        for name, (low, high) in ints.items():
            if getattr(self, name) is not None or name not in ("n_slots", "max_num_batched_tokens"):
                setattr(self, name, check_int(getattr(self, name), opt(name), low, high))
        if self.long_prompts > self.num_requests:
            raise ValueError(f"--long-prompts must be in [0, --num-requests = {self.num_requests}], got {self.long_prompts}")
        reals = {"rate": (MIN_RATE, MAX_RATE, False), "max_wait_s": (0.0, MAX_SECONDS, False),
                 "output_scale": (0.0, 1000.0, True)}
        optional_reals = {"target_itl_ms": (0.0, MAX_SECONDS * 1000, True), "aging_s": (0.0, MAX_SECONDS, True),
                          "slo_ttft_s": (0.0, MAX_SECONDS, True), "slo_tpot_s": (0.0, MAX_SECONDS, True)}
        for name, (low, high, low_open) in reals.items():
            setattr(self, name, check_real(getattr(self, name), opt(name), low, high, low_open=low_open))
        for name, (low, high, low_open) in optional_reals.items():
            if getattr(self, name) is not None:
                setattr(self, name, check_real(getattr(self, name), opt(name), low, high, low_open=low_open))
        for name, choices in (("arrival", ARRIVALS), ("clock", ("wall", "sim")),
                              ("preemption_mode", ("recompute", "swap")), ("orca_reservation", ("oracle", "max")),
                              ("policy_order", QUEUE_POLICIES), ("attention_backend", ("torch", "triton"))):
            check_choice(getattr(self, name), opt(name), choices)
        for name in ("adaptive_k", "check_reference", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_device(self.device, "--device")
        check_model_name(self.model, "--model")
        if self.draft_model is not None:
            check_model_name(self.draft_model, "--draft-model")
        for name in ("trace", "profile", "trace_out", "json_path", "figures_dir", "command"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (str, Path)):
                raise FieldTypeError(f"{'--json' if name == 'json_path' else opt(name)} must be a path (str) or None, "
                                     f"got {getattr(self, name)!r}")
        if self.trace is not None and not Path(self.trace).is_file():
            raise ValueError(f"--trace: no such file {self.trace!r}")
        if self.profile is not None and not Path(self.profile).is_file():
            raise ValueError(f"--profile: no such file {self.profile!r} (make one with python -m minibatch calibrate)")
        from minibatch.files import check_output_dir, check_output_file

        if self.json_path is not None:  # output paths: fail now, not after the run
            check_output_file(self.json_path, "--json")
        if self.figures_dir:
            check_output_dir(self.figures_dir, "--figures-dir")
        if self.trace_out is not None:
            check_output_dir(self.trace_out, "--trace-out")
        if self.trace is not None:  # a bad trace file fails now; its ids are checked against the vocab later
            from minibatch.workload import load_trace

            load_trace(self.trace)


def build_trace(cfg: CompareConfig, tokenizer, vocab_size: int) -> list[Request]:
    """cfg.trace read (token ids checked against ``vocab_size``), or a generated trace.

    Raises:
        ValueError: a bad trace file (names the file, the request index and the field).
    """
    from minibatch.workload import load_trace, make_trace

    if cfg.trace is not None:
        return load_trace(cfg.trace, vocab_size=vocab_size)
    return make_trace(
        cfg.num_requests, arrival=cfg.arrival, rate_per_s=cfg.rate, lengths="sharegpt",
        max_prompt_len=cfg.max_prompt_len, max_output_len=cfg.max_output_len, output_scale=cfg.output_scale,
        vocab_size=vocab_size, num_long_prompts=cfg.long_prompts, long_prompt_len=cfg.long_prompt_len,
        seed=cfg.seed, sampling=SamplingParams(ignore_eos=True), tokenizer=tokenizer,
    )


@torch.inference_mode()
def reference_outputs(model, requests: list[Request], progress: bool = False) -> dict[str, list[int]]:
    """HF ``generate`` on each greedy request alone: the ground truth for matches_reference.

    Greedy, ``max_new_tokens``, stopping at the model's EOS unless ``ignore_eos``, and nothing else:
    the checkpoint's generation_config (repetition_penalty, suppress_tokens, ...) is left out
    (``baselines.plain_generation_config``), since our engine implements none of it.
    Returns request_id -> output token ids.
    """
    from tqdm.auto import tqdm

    from minibatch.baselines import plain_generation, plain_generation_config
    from minibatch.models import attention_implementation

    refs = {}
    with attention_implementation(model, "sdpa"):
        for r in tqdm([r for r in requests if r.sampling.is_greedy], desc="reference", disable=not progress,
                      leave=False):
            ids = torch.tensor([r.prompt_token_ids], device=model.device)
            with plain_generation(model, plain_generation_config(model, r.max_new_tokens, r.sampling)) as cfg:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            refs[r.request_id] = out[0, ids.shape[1]:].tolist()
    return refs


def matches_reference(requests: list[Request], refs: dict[str, list[int]]) -> bool | None:
    """True if every greedy request's output equals its reference; None if none is greedy."""
    greedy = [r for r in requests if r.request_id in refs]
    if not greedy:
        return None
    return all(r.output_token_ids == refs[r.request_id] for r in greedy)


def _warm_up(runner, draft_runner=None) -> None:
    """One tiny run through both layouts so first-call costs don't land on the first policy."""
    from minibatch.sim.clock import SimClock

    for policy in ENGINE_POLICIES:
        if policy == "spec" and draft_runner is None:
            continue
        r = Request("warmup", [1, 2, 3, 4], 3, SamplingParams(ignore_eos=True))
        make_engine(policy, runner, SimClock(), n_slots=64, draft_runner=draft_runner).generate([r])


def default_draft(model: str) -> str:
    """The draft model of the ``spec`` policy: smollm2-135m-draft for smollm2-135m; for any other
    model the model itself (self-speculation: every draft accepted, no speedup, still exact)."""
    return "smollm2-135m-draft" if model == "smollm2-135m" else model


def load_draft_runner(name: str, target_name: str, model, tokenizer, device="cpu", attention_backend: str = "torch"):
    """A ModelRunner on the draft model ``name`` for the target ``model`` loaded as ``target_name``
    (the target's own model object when they are the same: self-speculation). smollm2-135m-draft's LM head is cut to
    the 8192 ids its target uses most (``models.draft_vocab_subset``, FR-Spec).

    Raises:
        ValueError: the draft's vocab_size differs from the target's (not the same tokenizer).
    """
    from minibatch.models import draft_vocab_subset, load_model
    from minibatch.runner import ModelRunner

    draft = model if name == target_name else load_model(name, device=str(device))[0]
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"draft model {name!r} has vocab_size {draft.config.vocab_size}, "
                         f"the target {model.config.vocab_size}: they must share a tokenizer")
    subset = draft_vocab_subset() if name == "smollm2-135m-draft" else None
    return ModelRunner(draft, tokenizer, attention_backend=attention_backend, vocab_subset=subset)


def kv_slots(cfg: CompareConfig, requests: list[Request]) -> int:
    """KV memory (token slots) every policy gets: by default what static batching needs for a
    padded batch in the worst case, batch_size * (longest prompt + longest max_new_tokens): every
    row of the (B, T) cache is as long as the batch's longest prompt plus its longest output.
    Same memory for both, as in Orca's evaluation: Orca turns it into a larger batch because it
    reserves each request's own prompt + max_new_tokens, not the batch's longest."""
    longest = max(r.num_prompt_tokens for r in requests) + max(r.max_new_tokens for r in requests)
    return cfg.n_slots or cfg.batch_size * longest


def make_compare_clock(cfg: CompareConfig, device="cpu"):
    """cfg.clock's clock: a WallClock, or a SimClock on cfg.profile (calibrated) or the default CostModel."""
    from minibatch.sim.clock import SimClock, make_clock
    from minibatch.sim.cost_model import Profile

    if cfg.clock == "sim" and cfg.profile:
        profile = Profile.load(cfg.profile)
        return SimClock(profile, profile)
    return make_clock(cfg.clock, device)


def run_policy(policy: str, cfg: CompareConfig, runner, model, requests: list[Request],
               draft_runner=None, clock=None) -> tuple[list[Request], Engine | None]:
    """Run fresh copies of ``requests`` under ``policy``; returns them (and the engine, if ours).
    runner: a ModelRunner or a SimExecutor; clock: default :func:`make_compare_clock`."""
    from minibatch.baselines import run_hf_generate, run_hf_generate_batch

    reqs = [r.copy() for r in requests]
    if policy in ENGINE_POLICIES:
        engine = make_engine(
            policy, runner, clock or make_compare_clock(cfg, getattr(runner, "device", "cpu")),
            max_bs=cfg.batch_size if policy == "static" else cfg.max_bs,
            n_slots=kv_slots(cfg, reqs), max_wait_s=cfg.max_wait_s,
            block_size=cfg.block_size if policy in PAGED_POLICIES else None,
            preemption_mode=cfg.preemption_mode,
            reserve_new_tokens=cfg.max_output_len if cfg.orca_reservation == "max" else None,
            max_num_batched_tokens=cfg.max_num_batched_tokens if policy.startswith("chunked") else None,
            target_itl_s=cfg.target_itl_ms / 1000 if cfg.target_itl_ms and policy.startswith("chunked") else None,
            queue_policy=cfg.policy_order, aging_s=cfg.aging_s,
            draft_runner=draft_runner, num_speculative_tokens=cfg.num_speculative_tokens, adaptive_k=cfg.adaptive_k,
        )
        return engine.generate(reqs, progress=cfg.progress), engine
    if policy == "hf_generate":
        return run_hf_generate(model, reqs, batch_size=cfg.batch_size, max_wait_s=cfg.max_wait_s, progress=cfg.progress), None
    return run_hf_generate_batch(model, reqs, progress=cfg.progress), None


def run_compare(cfg: CompareConfig) -> dict:
    """Run the comparison; print a table, save figures and (optionally) JSON. Returns the result dict."""
    from minibatch.metrics import SLO, summarize
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner

    t0 = time.perf_counter()
    model, tokenizer = load_model(cfg.model, device=cfg.device)
    print(f"model {cfg.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"loaded in {time.perf_counter() - t0:.1f} s")
    requests = build_trace(cfg, tokenizer, model.config.vocab_size)
    num_prompt = sum(r.num_prompt_tokens for r in requests)
    num_output = sum(r.max_new_tokens for r in requests)
    print(f"trace: {len(requests)} requests, {num_prompt} prompt + {num_output} output tokens, "
          f"arrivals over {requests[-1].arrival_time_s:.1f} s")
    runner = ModelRunner(model, tokenizer, attention_backend=cfg.attention_backend)
    too_long = [r.request_id for r in requests if r.max_num_tokens > runner.max_model_len]
    if too_long:  # fail before minutes of reference runs, never drop the requests silently
        raise ValueError(f"requests {too_long[:5]}{' ...' if len(too_long) > 5 else ''} need more than "
                         f"max_model_len = {runner.max_model_len} tokens (--max-prompt-len, --max-output-len)")
    from minibatch.runner.kv_owner import check_kv_fits

    check_kv_fits(kv_slots(cfg, requests) * (2 if cfg.preemption_mode == "swap" else 1), runner.kv_bytes_per_token,
                  runner.device, "--n-slots (KV cache" + (" and as much CPU swap space)" if cfg.preemption_mode == "swap" else ")"))
    draft_runner = None
    if "spec" in cfg.policies:
        draft_runner = load_draft_runner(cfg.draft_model or default_draft(cfg.model), cfg.model, model, tokenizer,
                                         runner.device, cfg.attention_backend)
    _warm_up(runner, draft_runner)
    refs = reference_outputs(model, requests, cfg.progress) if cfg.check_reference else {}

    result = {"command": cfg.command, "environment": environment(), "model": cfg.model, "device": cfg.device,
              "num_requests": len(requests), "clock": cfg.clock,
              "batch_size": cfg.batch_size, "max_bs": cfg.max_bs, "n_slots": kv_slots(cfg, requests),
              "block_size": cfg.block_size, "preemption_mode": cfg.preemption_mode,
              "orca_reservation": cfg.orca_reservation,
              "max_num_batched_tokens": cfg.max_num_batched_tokens, "target_itl_ms": cfg.target_itl_ms,
              "policy_order": cfg.policy_order, "aging_s": cfg.aging_s,
              "long_prompts": cfg.long_prompts, "long_prompt_len": cfg.long_prompt_len,
              "attention_backend": cfg.attention_backend,
              "draft_model": (cfg.draft_model or default_draft(cfg.model)) if "spec" in cfg.policies else None,
              "num_speculative_tokens": cfg.num_speculative_tokens, "adaptive_k": cfg.adaptive_k,
              "seed": cfg.seed, "policies": {}}
    runs = {}
    for policy in cfg.policies:
        t = time.perf_counter()
        reqs, engine = run_policy(policy, cfg, runner, model, requests, draft_runner)
        summary = summarize(reqs, engine.trace if engine else None, SLO(ttft_s=cfg.slo_ttft_s, tpot_s=cfg.slo_tpot_s))
        runs[policy] = (reqs, engine, summary)
        entry = policy_entry(policy, summary, engine, cfg, reqs)
        entry["matches_reference"] = matches_reference(reqs, refs) if cfg.check_reference else None
        entry["clock"] = cfg.clock if engine else "wall"
        entry["run_time_s"] = round(time.perf_counter() - t, 3)
        result["policies"][policy] = entry

    print_table(result)
    if cfg.figures_dir:
        result["figures"] = save_figures(runs, cfg.figures_dir)
    write_json(result, cfg.json_path)
    return result


def policy_entry(policy: str, summary, engine: Engine | None, cfg: CompareConfig, requests: list[Request]) -> dict:
    """A policy's JSON entry: the summary's metrics, prefix-cache and speculative-decoding
    statistics where they apply; with cfg.trace_out, also writes the run's Chrome trace there
    (``<trace_out>/<policy>.trace.json``) and records its path."""
    entry = dict(summary.to_dict())
    bm = getattr(engine.scheduler, "block_manager", None) if engine else None
    if bm is not None and bm.enable_prefix_caching:
        entry["prefix_cache_hit_rate"] = bm.prefix_cache_hit_rate
    if policy in SPEC_POLICIES:
        entry["spec_decoding"] = engine.executor.stats.as_dict()
    if cfg.trace_out and engine is not None:
        from minibatch.viz.chrome_trace import write_chrome_trace

        path = write_chrome_trace(Path(cfg.trace_out) / f"{policy}.trace.json", engine.trace, requests, policy)
        entry["chrome_trace"] = str(path)
    return entry


def load_runner(model_name: str, device: str = "cpu", clock: str = "wall", threads: int | None = None):
    """For benchmark scripts: ``(model, tokenizer, ModelRunner, clock_factory)``, where
    clock_factory() makes a fresh WallClock on ``device`` (clock "wall") or SimClock ("sim").
    threads: torch CPU threads (None: torch's choice)."""
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner
    from minibatch.sim.clock import SimClock, WallClock

    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name, device=device)
    return model, tokenizer, ModelRunner(model, tokenizer), (lambda: WallClock(device)) if clock == "wall" else SimClock


def write_json(result: dict, path: str | Path | None) -> None:
    """Write a benchmark result as indented, strict JSON (NaN/inf -> null: "metric undefined"),
    atomically (parent folders made; a failed write keeps the old file); nothing if path is None.
    See :mod:`minibatch.files`."""
    from minibatch.files import write_json as write_json_file

    if path:
        write_json_file(path, result, indent=2)
        print(f"wrote {path}")


def environment() -> dict:
    """Versions and machine, stored with every result so numbers can be compared honestly."""
    import os
    import platform

    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "machine": platform.machine(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def print_table(result: dict) -> None:
    cols = [("output_throughput_tok_s", "out tok/s", "{:.1f}"), ("total_throughput_tok_s", "total tok/s", "{:.1f}"),
            ("ttft_p50_s", "TTFT p50 s", "{:.3f}"), ("ttft_p99_s", "TTFT p99 s", "{:.3f}"),
            ("tpot_p50_s", "TPOT p50 s", "{:.4f}"), ("itl_p99_s", "ITL p99 s", "{:.3f}"),
            ("e2e_p50_s", "E2E p50 s", "{:.3f}"),
            ("goodput_req_s", "goodput r/s", "{:.3f}"), ("kv_waste_fraction", "KV waste", "{:.1%}"),
            ("max_num_running", "max running", "{}"), ("num_preemptions", "preempted", "{}"),
            ("matches_reference", "matches ref", "{}"), ("clock", "clock", "{}")]
    header = f"{'policy':<18}" + "".join(f"{c[1]:>13}" for c in cols)
    print(header)
    print("-" * len(header))
    for name, entry in result["policies"].items():
        cells = [fmt.format(entry.get(key)) if entry.get(key) is not None else "-" for key, _, fmt in cols]
        print(f"{name:<18}" + "".join(f"{c:>13}" for c in cells))
    p = result["policies"]
    for a, b in (("orca", "static"), ("paged", "orca"), ("paged_prefix", "paged"), ("chunked", "prefill_first")):
        if a in p and b in p:
            ratio = p[a]["output_throughput_tok_s"] / p[b]["output_throughput_tok_s"]
            print(f"{a} / {b} output throughput: {ratio:.2f}x")
    for a in SPEC_POLICIES:
        if a in p and "paged" in p:
            st = p[a]["spec_decoding"]
            print(f"{a} / paged output throughput: {p[a]['output_throughput_tok_s'] / p['paged']['output_throughput_tok_s']:.2f}x "
                  f"(acceptance rate {st['acceptance_rate']:.1%}, mean acceptance length {st['mean_acceptance_length']:.2f})")
    if "chunked" in p and "prefill_first" in p and p["chunked"]["itl_p99_s"]:
        print(f"prefill_first / chunked ITL p99: {p['prefill_first']['itl_p99_s'] / p['chunked']['itl_p99_s']:.2f}x")


def save_figures(runs: dict, figures_dir: str) -> list[str]:
    """Gantt charts of our engines' schedules, latency CDFs and throughput/latency bars."""
    import matplotlib.pyplot as plt

    from minibatch.viz import compare_gantt, kv_block_map, latency_cdf, save, throughput_latency_bars

    paths = []
    engines = {name: eng.trace for name, (_, eng, _) in runs.items() if eng is not None}
    if engines:
        fig = compare_gantt(engines, rows="slot", x="time")
        paths.append(save(fig, "compare_gantt", figures_dir))
        plt.close(fig)
    paged = {name: eng for name, (_, eng, _) in runs.items() if eng is not None and name in PAGED_POLICIES}
    if paged:
        fig, axes = plt.subplots(1, len(paged), figsize=(6 * len(paged), 4), layout="constrained", squeeze=False)
        for ax, (name, eng) in zip(axes[0], paged.items()):
            kv_block_map(eng.trace, eng.scheduler.block_manager.num_blocks, ax=ax, title=f"{name}: KV blocks per step")
        paths.append(save(fig, "compare_kv_block_map", figures_dir))
        plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4), layout="constrained")
    for ax, metric in zip(axes, ("ttft", "itl", "e2e")):
        latency_cdf({n: r for n, (r, _, _) in runs.items()}, metric=metric, ax=ax)
    paths.append(save(fig, "compare_latency_cdf", figures_dir))
    plt.close(fig)
    ax_tput, _ = throughput_latency_bars({n: s for n, (_, _, s) in runs.items()})
    paths.append(save(ax_tput.figure, "compare_throughput_latency", figures_dir))
    plt.close(ax_tput.figure)
    return [str(p) for p in paths]
