"""``python -m minibatch gpu-check``: everything that must work on a GPU, in one command and one JSON.

A GPU is often lent for minutes (a lab slot, a Colab session), so the check is one command that
needs no decisions: it runs each step below, records what it saw, and exits 1 if any step failed.

    step          on a CUDA device                                 CPU twin (no GPU)
    environment   device, driver, CUDA, torch/triton/transformers  the same, no device
    kernels       Triton kernels compiled, vs their torch refs     interpreted (TRITON_INTERPRET=1)
    cuda-tests    every test marked ``cuda``, kernels compiled     "needs a GPU"
    greedy-fp32   every engine policy x attention backend, token-  the same on CPU, but the Triton
                  exact against HF generate (fp32)                 backend runs chunked only
    greedy-bf16   the same in bfloat16 under the logprob-close     (interpreted: ~15 s a run)
                  rule (``minibatch.equivalence``)
    main-job      ``compare --device cuda`` (default policies,     ``compare`` on tiny-random-llama,
                  reference check on)                              12 requests, fp32
    benchmark     static, orca, paged, chunked, spec_ngram and     the same on tiny-random-llama,
                  both HF baselines on one saturated ShareGPT      16 requests
                  trace, output throughput and ratios
    profile       the step profile: components, roofline           tiny-random-llama, float32
    cuda-graphs   decode steps from CUDA graphs: tokens equal to   "needs a GPU"
                  HF generate, step times against eager steps

Models: the tiny random models for equality; the real smollm2-135m for the main job where its
weights are on the machine, else ``smollm2-135m-random`` (same shape, seeded random weights: the
step costs the same, the text is gibberish; the JSON says which ran). On CPU the whole check takes
about a minute. A later measurement that needs a GPU is one more :class:`Step` in :data:`STEPS`.

Result JSON (``--out``): ``{"command", "device", "complete", "passed", "environment", "steps": [{"name",
"what", "status": "passed" | "failed" | "needs a GPU", "seconds", "details"}]}``;
``details`` holds each step's numbers (and, for a failure, the error). It is written once every step has run; until
then the steps done so far are in ``NAME.partial.json`` next to it (:func:`progress_path`).
"""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from minibatch.checks import one_line
from minibatch.gpu_steps import (CheckContext, StepFailed, check_benchmark, check_cuda_tests, check_environment,
                                 check_greedy_bf16, check_greedy_fp32, check_kernels, check_main_job,
                                 check_profile, real_weights_available)

PASSED, FAILED, NEEDS_GPU = "passed", "failed", "needs a GPU"


@dataclass(frozen=True)
class Step:
    """One check: ``run(ctx) -> details`` raises (StepFailed or anything else) on failure;
    ``cuda_only`` steps are reported as "needs a GPU" on a CPU-only machine."""

    name: str
    what: str
    run: Callable[[CheckContext], dict]
    cuda_only: bool = False


@dataclass
class StepReport:
    name: str
    what: str
    status: str
    seconds: float
    details: dict = field(default_factory=dict)


def check_cuda_graphs(ctx: CheckContext) -> dict:
    """The ``cuda-graphs`` step: on tiny-random-llama in float32, ``paged`` with
    the triton backend token for token equal to HF ``generate`` with its decode steps replayed from graphs; then
    decode steps of 1 and 32 requests (context 256) on ``ctx.main_model`` in bf16, from graphs and eager.

    Raises:
        StepFailed: tokens differ, no step was replayed, or a recording failed."""
    from minibatch.clock import SimClock
    from minibatch.experiments.cuda_graphs import graph_step_times
    from minibatch.models import load_model
    from minibatch.policies import make_engine
    from minibatch.reference import reference_outputs
    from minibatch.runner import ModelRunner
    from minibatch.workload import make_trace

    model, tok = load_model("tiny-random-llama", device=ctx.device, dtype=torch.float32)
    requests = make_trace(8, arrival="zero", lengths="uniform", prompt_range=(3, 40), output_range=(3, 20),
                          vocab_size=min(model.config.vocab_size, 4096), seed=1)
    refs = reference_outputs(model, requests)
    runner = ModelRunner(model, tok, attention_backend="triton")
    done = [r.copy() for r in requests]
    make_engine("paged", runner, SimClock(), max_num_seqs=8, block_size=4, n_slots=1024).generate(done)
    graphs = runner.decode_graphs
    details = {"tiny_fp32_matches_reference": {r.request_id: r.output_token_ids for r in done} == refs,
               "tiny_graphs_recorded": sorted(graphs.graphs) if graphs else [], "tiny_graph_replays":
               graphs.replays if graphs else 0, "disabled": graphs.disabled if graphs else runner.graphs_unsupported}
    big, big_tok = load_model(ctx.main_model, device=ctx.device, dtype=torch.bfloat16)
    details["model"], details["steps"] = ctx.main_model, [graph_step_times(big, big_tok, n, 256, 20) for n in (1, 32)]
    problems = [p for p, bad in (("tokens differ from HF generate", not details["tiny_fp32_matches_reference"]),
                                 ("no decode step was replayed from a graph", not details["tiny_graph_replays"]),
                                 (f"graphs off: {details['disabled']}", details["disabled"] is not None),
                                 ("a step-time runner recorded no graph",
                                  any(not r["graph_replays"] or r["disabled"] for r in details["steps"]))) if bad]
    if problems:
        raise StepFailed("; ".join(problems), details)
    return details


STEPS: list[Step] = [
    Step("environment", "device, driver, CUDA, torch, triton and transformers versions", check_environment),
    Step("kernels", "Triton kernels (compiled on a GPU) against their torch references, fp32 and bf16",
         check_kernels),
    Step("cuda-tests", "every test marked cuda, kernels compiled", check_cuda_tests, cuda_only=True),
    Step("greedy-fp32", "every engine policy x attention backend equal to HF generate, fp32", check_greedy_fp32),
    Step("greedy-bf16", "the same in bf16 by the logprob-close rule", check_greedy_bf16),
    Step("main-job", "python -m minibatch compare on the device, reference check on", check_main_job),
    Step("benchmark", "one saturated ShareGPT trace: our policies vs HF generate and generate_batch",
         check_benchmark),
    Step("profile", "where a step's time goes: decode and prefill steps by component, on the roofline",
         check_profile),
    Step("cuda-graphs", "decode steps replayed from CUDA graphs: equal to HF generate, timed against eager steps",
         check_cuda_graphs, cuda_only=True),
]


# ----------------------------------------------------------------------------------------- driver


def default_out(device: str, steps: list[str] | None = None) -> str:
    """``data/gpu/gpu_check_<device name>.json`` (e.g. ``..._nvidia-h100-80gb-hbm3.json``), ``..._cpu.json``; a
    subset of the steps gets its own file (``..._cpu.kernels-profile.json``), not the whole check's."""
    name = torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else "cpu"
    subset = "." + "-".join(steps) if steps else ""
    return f"data/gpu/gpu_check_{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}{subset}.json"


def progress_path(out: str) -> Path:
    """Where a check in progress keeps the steps done so far (``out`` itself is written once, when all have run)."""
    path = Path(out)
    return path.with_name(f"{path.stem}.partial{path.suffix or '.json'}")


def _repo() -> Path | None:
    root = Path(__file__).resolve().parent.parent
    return root if (root / "tests").is_dir() else None


def run_gpu_check(device: str | None = None, steps: list[str] | None = None, bench_requests: int | None = None,
                  main_model: str | None = None, out: str | None = None, command: str | None = None,
                  echo: Callable[[str], None] = print) -> dict:
    """Run ``steps`` (default: all of :data:`STEPS`) on ``device`` (default: cuda when available), the main
    job on ``main_model`` (default: smollm2-135m where its weights are here, else smollm2-135m-random, on a
    GPU; tiny-random-llama on CPU);
    print one line per step as it ends and a summary; write the result JSON to ``out`` (default
    :func:`default_out`; atomically) once every step has run, and the steps done so far to :func:`progress_path`
    after each one (a lease that ends mid-check keeps them; an earlier ``out`` is left as it was). Returns the
    result dict (``passed``: every step ran, some on this device, and none failed).

    Raises:
        ValueError: an unknown step name, a device that is not available, or no GPU for steps that all need one.
    """
    from minibatch.checks import check_device
    from minibatch.files import check_output_file, write_json

    device = check_device(device or ("cuda" if torch.cuda.is_available() else "cpu"), "--device")
    names = [s.name for s in STEPS]
    unknown = [s for s in steps or [] if s not in names]
    if unknown:
        raise ValueError(f"--steps must be a comma-separated subset of {','.join(names)}, got {','.join(unknown)}")
    on_gpu = torch.device(device).type == "cuda"
    selected = [s.name for s in STEPS if not steps or s.name in steps]
    if not on_gpu and all(s.cuda_only for s in STEPS if s.name in selected):  # a check of nothing never passes
        raise ValueError(f"--steps {','.join(selected)}: every selected step needs a GPU and --device is {device}: "
                         "nothing would run")
    out = out or default_out(device, selected if steps else None)
    check_output_file(out, "--out")
    if main_model is None:
        main_model = ("smollm2-135m" if real_weights_available() else "smollm2-135m-random") if on_gpu \
            else "tiny-random-llama"
    ctx = CheckContext(device=device, bench_requests=bench_requests or (64 if on_gpu else 16), repo=_repo(),
                       main_model=main_model)
    reports = []
    for step in STEPS:
        if steps and step.name not in steps:
            continue
        t0 = time.perf_counter()
        if step.cuda_only and not on_gpu:
            report = StepReport(step.name, step.what, NEEDS_GPU, 0.0)
        else:
            try:
                report = StepReport(step.name, step.what, PASSED, 0.0, step.run(ctx))
            except Exception as e:  # a step's failure is a result: record it and go on with the others
                details = getattr(e, "details", {}) | {"error": f"{type(e).__name__}: {one_line(e)}"}
                if not isinstance(e, StepFailed):
                    details["traceback"] = traceback.format_exc(limit=-6)
                report = StepReport(step.name, step.what, FAILED, 0.0, details)
            if on_gpu:
                torch.cuda.synchronize(device)
        report.seconds = round(time.perf_counter() - t0, 2)
        reports.append(report)
        echo(summary_line(report))
        # written after every step (atomically): a lease that ends mid-check keeps the steps already done
        ran = [r for r in reports if r.status != NEEDS_GPU]  # passed: all ran, some here, and none failed
        complete = len(reports) == len(selected)
        result = {"command": command, "device": device, "complete": complete,
                  "passed": complete and bool(ran) and all(r.status == PASSED for r in ran),
                  "environment": next((r.details for r in reports if r.name == "environment"), None),
                  "steps": [vars(r) for r in reports]}
        write_json(out if complete else progress_path(out), result)
    progress_path(out).unlink(missing_ok=True)
    failed = [r.name for r in reports if r.status == FAILED]
    verdict = "passed" if result["passed"] else f"FAILED: {', '.join(failed)}" if failed else "FAILED: nothing ran"
    echo(f"gpu-check on {device}: {verdict} ({sum(r.seconds for r in reports):.0f} s); wrote {out}")
    return result


def summary_line(r: StepReport) -> str:
    """One readable line per step: status, name, seconds and its headline numbers or error."""
    d = r.details
    if r.status == FAILED:
        note = d.get("error", "")
    elif r.name == "environment" and d:
        note = (f"{d.get('gpu', 'no GPU')}, driver {d.get('driver')}, CUDA {d.get('cuda')}, torch {d.get('torch')}, "
                f"triton {d.get('triton')}{' (interpreted)' if d.get('triton_interpreted') else ''}, "
                f"transformers {d.get('transformers')}")
    elif r.name == "kernels" and d:
        worst = max(v for k, v in d.items() if k.endswith("_err"))
        note = f"{'compiled' if d['compiled'] else 'interpreted'}, worst max abs error {worst:.2g}"
    elif r.name == "cuda-tests" and d:
        note = f"{d['passed']} passed, {d['skipped']} skipped of {d['collected']}"
    elif r.name.startswith("greedy") and d:
        note = f"{sum(len(v) for v in d.values() if isinstance(v, dict))} runs match ({d['rule']} rule)"
    elif r.name == "main-job" and d:
        note = f"{d['model']} in {d['dtype']}: " + ", ".join(
            f"{p} {v['output_throughput_tok_s']:.0f} tok/s" for p, v in d["policies"].items())
    elif r.name == "benchmark" and d:
        note = (f"{d['model']}, {d['num_requests']} requests: best {d['best_continuous_policy']} "
                f"{d['output_throughput_tok_s'][d['best_continuous_policy']]:.0f} tok/s = "
                f"{d['best_vs_hf_generate']}x hf_generate, {d['best_vs_hf_generate_batch']}x hf_generate_batch")
    elif r.name == "cuda-graphs" and d:
        note = f"{d['model']}: " + ", ".join(f"decode {s['batch']} {s['step_ms']['triton']} ms from graphs, "
                                             f"{s['step_ms']['triton_eager']} eager" for s in d["steps"])
    else:
        note = ""
    return f"{r.status.upper():>11}  {r.name:<12} {r.seconds:7.1f} s  {note}".rstrip()
