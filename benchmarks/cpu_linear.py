"""float32 linear layers on our packed kernel (``minibatch/runner/prepack.py`` ``pack_linears``,
``minibatch/kernels/cpu_linear.cpp``: weights packed once in panels of 16 output features, a register-tiled
micro-kernel) against ``F.linear`` (MKL's GEMM) as is, on SmolLM2-135M:

* ``linears``: every linear layer of the model called once on ``rows`` random rows, in the model's order
  (their GFLOP/s: 2 x rows x the weights' elements over the time);
* ``engine``: whole decode steps of B requests with 256 cached tokens each, on two ModelRunners that differ only
  in the packing (two copies of the model), steps alternating between them; medians.

    python benchmarks/cpu_linear.py --json data/cpu/cpu_linear.json
"""

from __future__ import annotations

import sys

import torch

from fused_projections import parser, run_ways


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.set_defaults(batches="1,8,32,64")
    args = p.parse_args(argv)
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner
    from minibatch.runner.prepack import pack_linears

    torch.set_num_threads(args.threads)
    runners = {}
    for name, packed in (("f_linear", False), ("packed", True)):
        model, tokenizer = load_model("smollm2-135m", dtype="float32")
        if packed and not pack_linears(model):
            sys.exit("the packed kernel is not available here (no C++ compiler to build it, or not float32 on a CPU)")
        runners[name] = ModelRunner(model, tokenizer, attention_backend=args.attention_backend, prepack_weights=False)
    return run_ways(runners, args, "cpu_linear.py", argv, "float32")


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
