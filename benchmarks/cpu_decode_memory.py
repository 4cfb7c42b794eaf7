"""The ``cpp`` backend's decode attention (``--dtype``: bf16, or float32 for CPUs without native bf16) with its K/V
read from memory, as a decode step reads it:
SmolLM2-135M's shapes (30 layers, 9 query heads, 3 KV heads of 64, block_size 16) for ``--requests`` requests of
``--context`` tokens, each layer's K/V its own in a cache of ``--cache-gib`` GiB (on 2 MiB pages, as a CPU
ModelRunner allocates it), the blocks scattered at random; one sweep of the 30 layers per turn, so every layer's
K/V comes from memory. Today's kernel and, with ``--against-rev``, the kernel at that git revision (built from its
sources; an A/B in one process, the turns alternating, outputs checked equal), each two ways: a sweep of the 30
layers, and one layer's K/V again and again, warm in the caches (what the arithmetic and the cache hits cost
without memory).

    python benchmarks/cpu_decode_memory.py --against-rev REV --json data/cpu/cpu_decode_memory.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from fused_layers import commit_arg, kernel_sources_at
from minibatch.checks import MAX_TOKENS, OneLineParser, int_arg, output_file_arg, real_arg
from minibatch.report import environment, machine_load, write_json

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int_arg(1, 4096), default=32)
    p.add_argument("--context", type=int_arg(1, MAX_TOKENS), default=256)
    p.add_argument("--threads", type=int_arg(1, 1024), default=2)
    p.add_argument("--cache-gib", type=real_arg(0, 1024, low_open=True), default=2.0,
                   help="the KV cache the blocks are scattered over")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the cache's and q's")
    p.add_argument("--turns", type=int_arg(1, 100_000), default=60, help="30-layer sweeps per way")
    p.add_argument("--against-rev", type=commit_arg, default=None, help="also time the kernel at this git revision")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    args = p.parse_args(argv)
    n, blocks = args.requests, -(-args.context // BLOCK)
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    pool = int(args.cache_gib * 2**30) // (LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * size)
    if pool < n * blocks:  # before the kernels build
        p.error(f"--cache-gib {args.cache_gib} holds {pool} blocks a layer, fewer than the {n * blocks} the step reads")
    from minibatch.kernels import cpu_decode
    from minibatch.machine import huge_page_zeros

    torch.set_num_threads(args.threads)
    kernels = {"today": cpu_decode.load()}
    if args.against_rev:
        folder = kernel_sources_at(args.against_rev, "decode")
        kernels[args.against_rev] = cpu_decode.build(os.path.join(folder, os.path.basename(cpu_decode.SOURCE)))
    g = torch.Generator().manual_seed(0)
    cache = huge_page_zeros((LAYERS, 2, pool, BLOCK, KV_HEADS, HEAD_DIM), dtype)
    for layer in range(LAYERS):
        cache[layer].normal_(generator=g)
    tables = [torch.randperm(pool, generator=g)[: n * blocks].view(n, blocks) for _ in range(LAYERS)]
    lens, q = torch.full((n,), args.context), torch.randn(n, HEADS, HEAD_DIM, generator=g).to(dtype)
    scale = HEAD_DIM ** -0.5

    def sweep(kernel, layers) -> float:  # ms per layer
        t0 = time.perf_counter()
        for layer in layers:
            kernel.paged_decode(q, cache[layer, 0], cache[layer, 1], tables[layer], lens, scale, 0)
        return (time.perf_counter() - t0) * 1e3 / len(layers)

    outputs = [k.paged_decode(q, cache[0, 0], cache[0, 1], tables[0], lens, scale, 0) for k in kernels.values()]
    assert all(torch.equal(outputs[0], o) for o in outputs), "the kernels' outputs differ"
    load_before = machine_load()
    names = list(kernels)
    times = {name: [] for name in names} | {f"{name}_warm": [] for name in names}
    for turn in range(args.turns):
        for name in names if turn % 2 == 0 else names[::-1]:
            times[name].append(sweep(kernels[name], range(LAYERS)))
            times[f"{name}_warm"].append(sweep(kernels[name], [0] * LAYERS))
    gb = n * args.context * KV_HEADS * HEAD_DIM * 2 * size / 1e9  # K and V read per layer
    rows = {name: {"ms_per_layer": round(statistics.median(t), 4),
                   "gb_per_s": round(gb / statistics.median(t) * 1e3, 1),
                   "p10_p90_ms": [round(sorted(t)[len(t) // 10], 4), round(sorted(t)[len(t) * 9 // 10], 4)]}
            for name, t in times.items()}
    command = "python benchmarks/cpu_decode_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command,
              "environment": environment(load_before), "requests": n, "context": args.context, "threads": args.threads,
              "cache_gib": args.cache_gib, "dtype": args.dtype, "turns": args.turns,
              "kv_bytes_per_layer": int(gb * 1e9), "ways": rows}
    if args.against_rev:
        pairs = [b / a for a, b in zip(times["today"], times[args.against_rev])]
        result["speedup_over_rev"] = round(statistics.median(pairs), 3)  # the median of the turns' ratios
        warm = [b / a for a, b in zip(times["today_warm"], times[f"{args.against_rev}_warm"])]
        result["warm_speedup_over_rev"] = round(statistics.median(warm), 3)
    for name, row in rows.items():
        print(f"{name:>12}: {row['ms_per_layer']:.4f} ms per layer, {row['gb_per_s']} GB/s of K/V")
    if args.against_rev:
        print(f"today over {args.against_rev}: {result['speedup_over_rev']}x from memory, "
              f"{result['warm_speedup_over_rev']}x warm (medians of the turns' ratios)")
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
