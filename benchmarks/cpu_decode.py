"""The ``cpp`` attention backend's C++ paged decode kernel against ``sdpa``'s decode attention (K/V blocks gathered
into a padded tensor, then torch's fused attention), at two levels, each way interleaved with the others:

* ``kernel``: one layer's decode attention on SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64, block_size
  16, ``--dtype``: bf16, or float32 for CPUs without native bf16) for ``--requests`` requests whose contexts are
  all ``--context`` tokens ("equal") or drawn uniformly from 32 .. 2 x context ("mixed": sdpa pads every request
  to the longest);
* ``engine``: whole decode steps of SmolLM2-135M on ModelRunners that differ only in the backend (one model, each
  runner its own KV cache and the same requests), steps alternating between them; medians of ``--steps``.

    python benchmarks/cpu_decode.py --json data/cpu/cpu_decode.json

``--against-source OLD.cpp`` (e.g. ``git show REV:minibatch/kernels/cpu_paged_decode.cpp > OLD.cpp``) builds that
version of the kernel too and times it at the kernel level beside the current one ("cpp_before"): an A/B of a
kernel change in one process, calls interleaved.

The first run on a machine builds the kernel (tens of seconds, before any timing).
"""

from __future__ import annotations

import argparse
from pathlib import Path
import statistics
import sys
import time

import torch

from minibatch.checks import OneLineParser, int_arg, output_file_arg
from minibatch.report import environment, machine_load, write_json

BACKENDS = ("sdpa", "cpp")


def lengths(kind: str, n: int, context: int, g: torch.Generator) -> torch.Tensor:
    if kind == "equal":
        return torch.full((n,), context)
    return torch.randint(32, 2 * context + 1, (n,), generator=g)


def kernel_times(n: int, context: int, kind: str, repeats: int, before=None,
                 dtype: torch.dtype = torch.bfloat16) -> dict:
    """Median ms of one layer's decode attention per backend (and per ``before`` kernel, an A/B), and the largest
    difference between sdpa and cpp."""
    from minibatch.kernels import cpu_decode
    from minibatch.runner.backends.sdpa import SdpaAttentionData, decode_attention

    heads, kv_heads, d, block = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    lens = lengths(kind, n, context, g)
    blocks = -(-int(lens.max()) // block)
    pool = n * blocks * 2
    k_cache, v_cache = (torch.randn(pool, block, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(pool, generator=g)[: n * blocks].view(n, blocks)
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    mask = (torch.arange(blocks * block)[None, :] < lens[:, None])[:, None, None, :]
    data = SdpaAttentionData(write_all=True, decode_tables=tables, decode_mask=mask)
    ways = {"sdpa": lambda: decode_attention(q, k_cache, v_cache, data, d ** -0.5),
            "cpp": lambda: cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, d ** -0.5)}
    if before is not None:  # both versions called bare (no profiler range around either): the A/B pair
        now = cpu_decode.load()
        ways["cpp_bare"] = lambda: now.paged_decode(q, k_cache, v_cache, tables, lens, d ** -0.5, 0)
        ways["cpp_before"] = lambda: before.paged_decode(q, k_cache, v_cache, tables, lens, d ** -0.5, 0)
    diff = (ways["sdpa"]().float() - ways["cpp"]().float()).abs().max().item()
    times = {name: [] for name in ways}
    names = list(ways)
    for r in range(repeats):  # the order rotates: a way run right after another finds its K/V warm in the caches
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            ways[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: round(statistics.median(t), 3) for name, t in times.items()} | {"max_abs_diff": diff}


def engine_times(model, tokenizer, n: int, context: int, kind: str, steps: int) -> dict:
    """Median ms of a whole decode step per backend (steps alternating between the runners)."""
    from minibatch.experiment import alternating_step_ms, decoding_engine
    from minibatch.runner import ModelRunner

    engines = {}
    for name in BACKENDS:
        runner = ModelRunner(model, tokenizer, attention_backend=name)
        engines[name] = decoding_engine(runner, lengths(kind, n, context, torch.Generator().manual_seed(1)).tolist(),
                                        steps + 8)
    return alternating_step_ms(engines, steps)


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int_arg(1, 4096), default=32)
    p.add_argument("--context", type=int_arg(1, 8192), default=256,
                   help="tokens of context per request (equal; mixed: mean)")
    p.add_argument("--threads", type=int_arg(1, 1024), default=2)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the model's and cache's")
    p.add_argument("--repeats", type=int_arg(1, 100_000), default=100, help="kernel calls per way")
    p.add_argument("--steps", type=int_arg(1, 100_000), default=30, help="engine decode steps per backend")
    p.add_argument("--against-source", default=None, help="another version of cpu_paged_decode.cpp to time beside "
                   "the current kernel (kernel level)")
    p.add_argument("--skip-engine", action="store_true", help="kernel level only")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    args = p.parse_args(argv)
    if args.against_source is not None and not Path(args.against_source).is_file():
        p.error(f"--against-source {args.against_source}: no such file")
    from minibatch.kernels import cpu_decode
    from minibatch.models import load_model

    cpu_decode.load()  # the builds, before any timing
    before = cpu_decode.build(args.against_source) if args.against_source else None
    model, tokenizer = load_model("smollm2-135m", dtype=args.dtype)
    load_before = machine_load()
    torch.set_num_threads(args.threads)
    rows = []
    for kind in ("equal", "mixed"):
        kernel = kernel_times(args.requests, args.context, kind, args.repeats, before, getattr(torch, args.dtype))
        row = {"lengths": kind, "kernel_ms": kernel, "kernel_speedup": round(kernel["sdpa"] / kernel["cpp"], 2)}
        if before is not None:
            row["kernel_speedup_over_before"] = round(kernel["cpp_before"] / kernel["cpp_bare"], 2)
        if not args.skip_engine:
            engine = engine_times(model, tokenizer, args.requests, args.context, kind, args.steps)
            row |= {"engine_step_ms": engine, "engine_step_speedup": round(engine["sdpa"] / engine["cpp"], 2)}
        print(row)
        rows.append(row)
    result = {"command": "python benchmarks/cpu_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": environment(load_before), "model": "smollm2-135m", "dtype": args.dtype,
              "requests": args.requests, "context": args.context, "threads": args.threads, "rows": rows}
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
