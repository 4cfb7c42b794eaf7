"""Sibling projections as one product (``minibatch/runner/prepack.py``: q/k/v_proj and gate/up_proj of a module
share one weight, prepacked in bf16) against the same linears one by one (prepacked in bf16), on SmolLM2-135M
(``--dtype float32``: ``--layout plain``, both as loaded, the groups running ``F.linear``, which measured no gain;
``--layout panels``, both packed for our float32 kernel, the way the runner runs float32):

* ``linears``: every linear layer of the model called once on ``rows`` random rows, in the model's order (a fused
  group's later members take their columns of the first one's product);
* ``engine``: whole decode steps of B requests with 256 cached tokens each, on two ModelRunners that differ only
  in the fusion (two copies of the model), steps alternating between them; medians.

    python benchmarks/fused_projections.py --json data/cpu/fused_projections.json
    python benchmarks/fused_projections.py --dtype float32 --json data/cpu/fused_projections_float32.json
    python benchmarks/fused_projections.py --dtype float32 --layout panels --json data/cpu/fused_panels.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from minibatch.checks import OneLineParser, int_arg, ints_arg, output_file_arg
from minibatch.report import environment, machine_load, write_json
from minibatch.runner.backends import backend_names


def linear_times(models: dict, rows: int, repeats: int) -> dict:
    """Median ms of all of each model's linear layers on ``rows`` rows (the ways alternating), called as in the
    engine's steps (``engine_linears``: float32 packed layers run their kernel there only)."""
    from minibatch.runner.prepack import engine_linears

    calls = {}
    for name, model in models.items():
        layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        dtype = next(model.parameters()).dtype
        inputs = {m.in_features: torch.randn(rows, m.in_features).to(dtype) for m in layers}
        calls[name] = [(m, inputs[m.in_features]) for m in layers]
    times = {name: [] for name in models}
    with torch.inference_mode(), engine_linears():
        for _ in range(repeats + 2):
            for name, pairs in calls.items():
                t0 = time.perf_counter()
                for m, x in pairs:
                    m(x)
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: round(statistics.median(t[2:]), 2) for name, t in times.items()}


def step_times(runners: dict, n: int, steps: int, context: int = 256) -> dict:
    """Median ms of a decode step of ``n`` requests per runner (steps alternating)."""
    from minibatch.experiment import alternating_step_ms, decoding_engine

    engines = {name: decoding_engine(runner, [context] * n, steps + 8) for name, runner in runners.items()}
    return alternating_step_ms(engines, steps)


def parser(doc: str) -> argparse.ArgumentParser:
    """The options this benchmark shares with ``cpu_linear.py``."""
    p = OneLineParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=ints_arg(1, 4096), default="1,8,32",
                   help="decode batch sizes (rows of the linears-alone timing)")
    p.add_argument("--threads", type=int_arg(1, 1024), default=2)
    p.add_argument("--attention-backend", choices=backend_names(), default="cpp")
    p.add_argument("--repeats", type=int_arg(1, 100_000), default=20, help="linears-alone passes per way")
    p.add_argument("--steps", type=int_arg(1, 100_000), default=25, help="decode steps per way and batch")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    return p


def run_ways(runners: dict, args, script: str, argv, dtype: str, extra: dict | None = None) -> dict:
    """Both ways (``runners``: name -> ModelRunner, the baseline first) at every batch size: linears alone and whole
    decode steps, the speedups of the second way over the first; written to ``args.json_path`` with ``extra``'s
    entries."""
    base, new = list(runners)
    load_before = machine_load()
    rows = []
    weights = sum(m.weight.numel() for m in runners[base].model.modules() if isinstance(m, torch.nn.Linear))
    for n in args.batches:
        linears = linear_times({k: r.model for k, r in runners.items()}, n, args.repeats)
        steps = step_times(runners, n, args.steps)
        row = {"batch": n, "linears_ms": linears,
               "linears_gflop_per_s": {k: round(2 * n * weights / (ms * 1e6), 1) for k, ms in linears.items()},
               "decode_step_ms": steps,
               "linears_speedup": round(linears[base] / linears[new], 2),
               "step_speedup": round(steps[base] / steps[new], 2)}
        print(row)
        rows.append(row)
    result = {"command": f"python benchmarks/{script} " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": environment(load_before), "model": "smollm2-135m", "dtype": dtype,
              "attention_backend": args.attention_backend, "threads": args.threads, "rows": rows} | (extra or {})
    write_json(result, args.json_path)
    return result


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="bfloat16: prepacked for oneDNN (needs a CPU with native bf16); float32: see --layout")
    p.add_argument("--layout", choices=("plain", "panels"), default="plain",
                   help="float32 only: plain, as loaded (F.linear); panels, packed for our kernel")
    args = p.parse_args(argv)
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner
    from minibatch.runner.prepack import can_prepack, fuse_siblings, pack_linears, prepack_linears

    torch.set_num_threads(args.threads)
    runners = {}
    for name, fuse in (("one_by_one", False), ("fused", True)):
        model, tokenizer = load_model("smollm2-135m", dtype=args.dtype)
        if args.dtype == "bfloat16":
            if not can_prepack(model):
                sys.exit("no oneDNN bf16 on this CPU: bf16 weights are not prepacked here (try --dtype float32)")
            prepack_linears(model, fuse=fuse)
        elif args.layout == "panels":
            if not pack_linears(model, fuse=fuse):
                sys.exit("the packed float32 kernel is not available here (no C++ compiler to build it)")
        elif fuse:
            fuse_siblings(model, layout="plain")
        runners[name] = ModelRunner(model, tokenizer, attention_backend=args.attention_backend, prepack_weights=False)
    return run_ways(runners, args, "fused_projections.py", argv, args.dtype)


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
