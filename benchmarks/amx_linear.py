"""The AMX bf16 linear (``minibatch/kernels/cpu_amx_linear.cpp``) against oneDNN's matmul on the same prepacked
weights (``minibatch/runner/prepack.py``), on SmolLM2-135M in bf16 on a CPU with AMX: two copies of the model, both
prepacked with q/k/v and gate/up grouped, one with the AMX kernel turned off (every product on oneDNN):

* ``linears``: every linear layer of the model called once on ``rows`` random rows, in the model's order;
* ``engine``: whole decode steps of B requests with 256 cached tokens each, on two ModelRunners (fused decode
  layers, ``cpp`` attention) that differ only in that, steps alternating between them; medians;
* ``call_overhead_us``: one call of each on a 64 x 64 weight and 32 rows (what a call costs before its work).

    python benchmarks/amx_linear.py --batches 1,8,32,64 --json data/cpu/amx_linear.json

Above ``AMX_MAX_ROWS`` (32) rows both ways run oneDNN: the 64-request row shows what is left equal. ``--amx-rows N``
lets the AMX way run products of up to N rows (64 at most) on the kernel, to measure it above 32 rows:

    python benchmarks/amx_linear.py --batches 32,48,64 --amx-rows 64 --json data/cpu/amx_linear_64_rows.json

``benchmarks/bf16_linear.py`` runs the same comparison for the AVX512-BF16 kernel (``kernel="bf16"``).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from fused_projections import parser, run_ways

from minibatch.checks import int_arg


def kernel_off(model, kernel: str) -> None:
    """Every prepacked product of ``model`` on oneDNN (the layers' and groups' ``kernel`` flags cleared: "amx" or
    "bf16", ``runner.prepack.prepacked_product``'s)."""
    for module in model.modules():
        for holder in (module, getattr(module, "group", None)):
            if hasattr(holder, kernel):
                setattr(holder, kernel, False)


def call_overhead_us(kernel: str, calls: int = 2000) -> dict:
    """Microseconds per call of oneDNN and of ``kernel`` ("amx" or "bf16") on a 64 x 64 weight and 32 rows (the work
    is nanoseconds), ways alternating, the median of 5 rounds."""
    from minibatch.kernels import cpu_amx_linear, cpu_bf16_linear

    fn = {"amx": cpu_amx_linear.amx_linear, "bf16": cpu_bf16_linear.bf16_linear}[kernel]
    w = torch.randn(64, 64).to(torch.bfloat16)
    packed, x = torch.ops.mkldnn._reorder_linear_weight(w, 32), torch.randn(32, 64).to(torch.bfloat16)
    ways = {"onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
            kernel: lambda: fn(x, packed, 64, None)}
    times = {name: [] for name in ways}
    for _ in range(5):
        for name, call in ways.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def main(argv=None, kernel: str = "amx", doc: str = __doc__) -> dict:
    """Both ways for ``kernel`` ("amx": this file's benchmark; "bf16": ``bf16_linear.py``'s)."""
    p = parser(doc)
    if kernel == "amx":
        p.add_argument("--amx-rows", type=int_arg(1, 64), default=None,
                       help="products of up to this many rows run the AMX kernel in the AMX way (default: "
                            "AMX_MAX_ROWS, 32; above it its outputs are not oneDNN's bit for bit, each row still "
                            "its own one-row result)")
    args = p.parse_args(argv)
    if getattr(args, "amx_rows", None) is not None:
        from minibatch.kernels import cpu_amx_linear

        cpu_amx_linear.AMX_MAX_ROWS = args.amx_rows  # read when the runners below are built and at every product
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner
    from minibatch.runner.prepack import can_prepack, prepack_linears

    torch.set_num_threads(args.threads)
    runners = {}
    for name in ("onednn", kernel):
        model, tokenizer = load_model("smollm2-135m", dtype="bfloat16")
        if not can_prepack(model):
            sys.exit("no oneDNN bf16 on this CPU: bf16 weights are not prepacked here")
        prepack_linears(model)
        if name == "onednn":
            kernel_off(model, kernel)
        elif not any(getattr(m, kernel, False) for m in model.modules()):
            sys.exit(f"the {kernel} linear does not run here (no such instructions or oneDNN layout on this CPU, or "
                     "the kernel does not build)")
        runners[name] = ModelRunner(model, tokenizer, attention_backend=args.attention_backend, prepack_weights=False)
    overhead = call_overhead_us(kernel)
    print("call overhead (us):", overhead)
    return run_ways(runners, args, f"{kernel}_linear.py", argv, "bfloat16", {"call_overhead_us": overhead})


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
