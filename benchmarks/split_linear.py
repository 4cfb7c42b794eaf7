"""float32 linear layers with their output features split across the CPU's threads (``minibatch/runner/prepack.py``
``split_linears``, ``minibatch/kernels/cpu_split_linear.cpp``) against ``F.linear`` as is, on SmolLM2-135M:

* ``linears``: every linear layer of the model called once on ``rows`` random rows, in the model's order;
* ``engine``: whole decode steps of B requests with 256 cached tokens each, on two ModelRunners that differ only
  in the split (two copies of the model), steps alternating between them; medians.

    python benchmarks/split_linear.py --json data/cpu/split_linear.json
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
    from minibatch.runner.prepack import split_linears

    torch.set_num_threads(args.threads)
    runners = {}
    for name, split in (("as_is", False), ("split", True)):
        model, tokenizer = load_model("smollm2-135m", dtype="float32")
        if split and not split_linears(model):
            sys.exit("the split is not available here (no C++ compiler to build its kernel, or not float32 on a CPU)")
        runners[name] = ModelRunner(model, tokenizer, attention_backend=args.attention_backend, prepack_weights=False)
    return run_ways(runners, args, "split_linear.py", argv, "float32")


if __name__ == "__main__":
    main()
