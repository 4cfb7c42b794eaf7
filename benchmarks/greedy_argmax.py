"""The greedy token of every row of a decode step's logits: ``torch.argmax`` over whole rows against the sampler's
two-pass ``greedy_tokens`` (``minibatch/runner/sampler.py``: the max of each 1024-entry chunk, then the argmax of
the chunk maxima and within the winning chunk), on CPU float32 logits of SmolLM2-135M's vocabulary (49152) and a
Llama-2 sized one (32000, not a multiple of the chunk).

    python benchmarks/greedy_argmax.py --json data/cpu/greedy_argmax.json

Both ways give the same indices (checked on every shape); times are medians of ``--repeats`` calls, interleaved.
"""

from __future__ import annotations

import argparse
import sys

import torch

from minibatch.experiment import alternating_ms
from minibatch.report import environment, machine_load, write_json
from minibatch.runner.sampler import greedy_tokens


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,64", help="decode batch sizes (rows of logits)")
    p.add_argument("--vocab-sizes", default="49152,32000")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    load_before = machine_load()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    shapes = []
    for vocab in (int(v) for v in args.vocab_sizes.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            logits = torch.randn(rows, vocab, generator=g)
            assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
            ways = {"argmax_ms": lambda: logits.argmax(-1), "greedy_tokens_ms": lambda: greedy_tokens(logits)}
            times = alternating_ms(ways, args.repeats)
            row = {"rows": rows, "vocab_size": vocab, **{k: round(t, 4) for k, t in times.items()}}
            row["speedup"] = round(row["argmax_ms"] / row["greedy_tokens_ms"], 2)
            print(row)
            shapes.append(row)
    result = {"command": "python benchmarks/greedy_argmax.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": environment(load_before), "threads": args.threads, "dtype": "float32", "shapes": shapes}
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    main()
