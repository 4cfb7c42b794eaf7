"""Fused decode layers (``minibatch/runner/fused_layers.py``, ``minibatch/kernels/cpu_decode_layer.cpp``: one C++
call per decoder layer in an all-decode float32 step) against the model's own forward (the same packed linears and
``cpp`` attention kernel, called module by module), on SmolLM2-135M: whole decode steps of B requests with 256
cached tokens each, two ModelRunners on one model that differ only in ``fuse_decode_layers``, steps alternating
between them; medians.

    python benchmarks/fused_layers.py --json data/cpu/fused_layers.json
"""

from __future__ import annotations

import sys

import torch

from fused_projections import parser, step_times


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.set_defaults(batches="1,8,32,64")
    args = p.parse_args(argv)
    from minibatch.models import load_model
    from minibatch.report import environment, machine_load, write_json
    from minibatch.runner import ModelRunner

    torch.set_num_threads(args.threads)
    load_before = machine_load()
    model, tokenizer = load_model("smollm2-135m", dtype="float32")
    runners = {name: ModelRunner(model, tokenizer, attention_backend="cpp", fuse_decode_layers=fuse)
               for name, fuse in (("modules", False), ("fused", True))}
    if runners["fused"].fused_decoder is None:
        sys.exit("fused decode layers are not available here (no C++ compiler to build them)")
    rows = []
    for n in (int(b) for b in args.batches.split(",")):
        steps = step_times(runners, n, args.steps)
        rows.append({"batch": n, "decode_step_ms": steps, "step_speedup": round(steps["modules"] / steps["fused"], 2)})
        print(rows[-1])
    result = {"command": "python benchmarks/fused_layers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": environment(load_before), "model": "smollm2-135m", "dtype": "float32",
              "attention_backend": "cpp", "threads": args.threads, "rows": rows}
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    main()
