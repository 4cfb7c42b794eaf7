"""float32 linear layers with their output features split across the CPU's threads (``minibatch/runner/prepack.py``
``split_linears``, ``minibatch/kernels/cpu_split_linear.cpp``) against ``F.linear`` as is, on SmolLM2-135M:

* ``linears``: every linear layer of the model called once on ``rows`` random rows, in the model's order;
* ``engine``: whole decode steps of B requests with 256 cached tokens each, on two ModelRunners that differ only
  in the split (two copies of the model), steps alternating between them; medians.

    python benchmarks/split_linear.py --json data/cpu/split_linear.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from fused_projections import linear_times, step_times
from minibatch.report import environment, machine_load, write_json


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes (rows of the linears-alone timing)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--attention-backend", default="cpp")
    p.add_argument("--repeats", type=int, default=20, help="linears-alone passes per way")
    p.add_argument("--steps", type=int, default=25, help="decode steps per way and batch")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner
    from minibatch.runner.prepack import split_linears

    torch.set_num_threads(args.threads)
    runners = {}
    for name, split in (("as_is", False), ("split", True)):
        model, tokenizer = load_model("smollm2-135m", dtype="float32")
        if split and not split_linears(model):
            sys.exit("the split is not available here (no C++ build, one thread, or not bit-identical)")
        runners[name] = ModelRunner(model, tokenizer, attention_backend=args.attention_backend, prepack_weights=False)
    load_before = machine_load()
    rows = []
    for n in (int(b) for b in args.batches.split(",")):
        linears = linear_times({k: r.model for k, r in runners.items()}, n, args.repeats)
        steps = step_times(runners, n, args.steps)
        row = {"batch": n, "linears_ms": linears, "decode_step_ms": steps,
               "linears_speedup": round(linears["as_is"] / linears["split"], 2),
               "step_speedup": round(steps["as_is"] / steps["split"], 2)}
        print(row)
        rows.append(row)
    result = {"command": "python benchmarks/split_linear.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": environment(load_before), "model": "smollm2-135m", "dtype": "float32",
              "attention_backend": args.attention_backend, "threads": args.threads, "rows": rows}
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    main()
