"""The greedy token of every row of a decode step's logits, three ways: ``torch.argmax`` over whole rows; the
sampler's two-pass torch path (``minibatch/runner/sampler.py``'s ``two_pass_argmax``: the max of each 1024-entry
chunk, then the argmax of the chunk maxima and within the winning chunk); and the one-pass C++ kernel its
``greedy_tokens`` uses where the fused layers' extension is built with AVX-512 (``minibatch/kernels/cpu_argmax.cpp``;
left out where it does not run). On CPU logits (``--dtype``) of SmolLM2-135M's vocabulary (49152) and a Llama-2
sized one (32000, not a multiple of the chunk).

    python benchmarks/greedy_argmax.py --json data/cpu/greedy_argmax.json
    python benchmarks/greedy_argmax.py --dtype bfloat16 --json data/cpu/greedy_argmax_bfloat16.json

Every way gives the same indices (checked on every shape); times are medians of ``--repeats`` calls, interleaved.
"""

from __future__ import annotations

import argparse
import sys

import torch

from minibatch.checks import OneLineParser, int_arg, ints_arg, output_file_arg
from minibatch.experiment import alternating_ms
from minibatch.kernels import cpu_decode_layer
from minibatch.report import environment, machine_load, write_json
from minibatch.runner.sampler import two_pass_argmax


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=ints_arg(1, 4096), default="1,8,32,64", help="decode batch sizes (rows of logits)")
    p.add_argument("--vocab-sizes", type=ints_arg(1, 1 << 20), default="49152,32000")
    p.add_argument("--threads", type=int_arg(1, 1024), default=2)
    p.add_argument("--repeats", type=int_arg(1, 100_000), default=200)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the logits'")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    args = p.parse_args(argv)
    load_before = machine_load()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    kernel = cpu_decode_layer.available() and cpu_decode_layer.KERNEL.module.greedy_argmax_vectorized()
    shapes = []
    for vocab in args.vocab_sizes:
        for rows in args.rows:
            logits = torch.randn(rows, vocab, generator=g).to(getattr(torch, args.dtype))
            ways = {"argmax_ms": lambda: logits.argmax(-1), "two_pass_ms": lambda: two_pass_argmax(logits)}
            if kernel:
                ways["kernel_ms"] = lambda: cpu_decode_layer.greedy_argmax(logits)
            assert all(torch.equal(way(), logits.argmax(-1)) for way in ways.values())
            times = alternating_ms(ways, args.repeats)
            row = {"rows": rows, "vocab_size": vocab, **{k: round(t, 4) for k, t in times.items()}}
            row["two_pass_speedup"] = round(row["argmax_ms"] / row["two_pass_ms"], 2)
            if kernel:
                row["kernel_speedup_over_two_pass"] = round(row["two_pass_ms"] / row["kernel_ms"], 2)
            print(row)
            shapes.append(row)
    result = {"command": "python benchmarks/greedy_argmax.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": environment(load_before), "threads": args.threads, "dtype": args.dtype, "kernel": kernel,
              "shapes": shapes}
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
