"""The KV cache on 2 MiB pages (``minibatch.machine.huge_page_zeros``, how a CPU ModelRunner allocates it) against
the same cache on the default 4 KiB pages, at two levels, each an A/B in one process with the two ways taking turns:

* ``kernel``: the ``cpp`` backend's decode attention (``kernels.cpu_decode``) over every layer of SmolLM2-135M's
  shapes (30 layers, 9 query heads, 3 KV heads of 64, block_size 16, bf16) for ``--requests`` requests of
  ``--context`` tokens, their blocks scattered at random over the whole cache, one sweep of the 30 layers per turn
  (so each layer's K/V comes from memory, as in a step); caches of twice the step's blocks and of 2 GiB (the
  saturated trace's ``--kv-cache-memory-bytes``; a step of more blocks than it holds is refused);
* ``engine``: whole decode steps of SmolLM2-135M (bf16, ``cpp`` attention, fused decode layers) on two ModelRunners
  that differ only in their KV cache's pages, steps alternating; medians of ``--steps``.

    python benchmarks/kv_huge_pages.py --json data/cpu/kv_huge_pages.json

Needs Linux with transparent huge pages in "madvise" mode (else both ways are the same and the script says so).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from minibatch.checks import MAX_TOKENS, OneLineParser, int_arg, output_file_arg
from minibatch.machine import huge_page_zeros, huge_pages_state, transparent_huge_pages
from minibatch.report import environment, machine_load, write_json

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


@contextmanager
def plain_pages():
    """``huge_page_zeros`` as ``torch.zeros`` while the block runs (MINIBATCH_HUGE_PAGES=0)."""
    before = os.environ.get("MINIBATCH_HUGE_PAGES")
    os.environ["MINIBATCH_HUGE_PAGES"] = "0"
    try:
        yield
    finally:
        os.environ.pop("MINIBATCH_HUGE_PAGES") if before is None else os.environ.update(MINIBATCH_HUGE_PAGES=before)


def kernel_times(n: int, context: int, pool: int, repeats: int) -> dict:
    """Median ms per layer of the decode attention on each cache (2 MiB pages: "huge"; 4 KiB: "plain"), and GB/s of
    K/V read."""
    from minibatch.kernels import cpu_decode

    kernel = cpu_decode.load()
    g = torch.Generator().manual_seed(0)
    shape = (LAYERS, 2, pool, BLOCK, KV_HEADS, HEAD_DIM)
    caches = {"huge": huge_page_zeros(shape, torch.bfloat16)}
    state = huge_pages_state()
    with plain_pages():
        caches["plain"] = huge_page_zeros(shape, torch.bfloat16)
    for layer in range(LAYERS):  # the same values in both
        values = torch.randn(shape[1:], generator=g).bfloat16()
        for cache in caches.values():
            cache[layer].copy_(values)
    blocks = -(-context // BLOCK)
    tables = torch.randperm(pool, generator=g)[: n * blocks].view(n, blocks)
    lens = torch.full((n,), context)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g).bfloat16()
    outs = {}

    def sweep(cache):
        for layer in range(LAYERS):
            out = kernel.paged_decode(q, cache[layer, 0], cache[layer, 1], tables, lens, HEAD_DIM ** -0.5, 0)
        return out

    times = {name: [] for name in caches}
    for r in range(repeats + 1):
        for name in (("huge", "plain") if r % 2 else ("plain", "huge")):
            t0 = time.perf_counter()
            outs[name] = sweep(caches[name])
            if r:  # the first sweep of each is the warm-up
                times[name].append((time.perf_counter() - t0) * 1e3 / LAYERS)
    assert torch.equal(outs["huge"], outs["plain"])
    read = n * context * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16, one layer
    ms = {name: statistics.median(t) for name, t in times.items()}
    return {"cache_gib": round(LAYERS * 2 * pool * BLOCK * KV_HEADS * HEAD_DIM * 2 / 2**30, 2), "huge_pages": state,
            **{f"{name}_ms_per_layer": round(t, 4) for name, t in ms.items()},
            **{f"{name}_gb_per_s": round(read / t / 1e6, 1) for name, t in ms.items()},
            "speedup": round(ms["plain"] / ms["huge"], 3)}


def engine_times(n: int, context: int, steps: int) -> dict:
    """Median ms of a whole decode step on each runner (steps alternating)."""
    from minibatch.experiment import alternating_step_ms, decoding_engine
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner

    model, tokenizer = load_model("smollm2-135m", dtype="bfloat16")
    engines = {"huge": decoding_engine(ModelRunner(model, tokenizer, attention_backend="cpp"), [context] * n,
                                       steps + 8)}
    state = huge_pages_state()
    with plain_pages():
        engines["plain"] = decoding_engine(ModelRunner(model, tokenizer, attention_backend="cpp"), [context] * n,
                                           steps + 8)
    ms = alternating_step_ms(engines, steps)
    return {"huge_pages": state, **{f"{name}_step_ms": t for name, t in ms.items()},
            "speedup": round(ms["plain"] / ms["huge"], 3)}


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int_arg(1, 4096), default=32)
    p.add_argument("--context", type=int_arg(1, MAX_TOKENS), default=256)
    p.add_argument("--threads", type=int_arg(1, 1024), default=2)
    p.add_argument("--repeats", type=int_arg(1, 100_000), default=30, help="30-layer sweeps per way (kernel level)")
    p.add_argument("--steps", type=int_arg(1, 100_000), default=40, help="decode steps per way (engine level)")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    args = p.parse_args(argv)
    blocks = args.requests * -(-args.context // BLOCK)
    per_block = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 2
    if blocks > (2 << 30) // per_block:
        p.error(f"--requests {args.requests} --context {args.context}: the step reads {blocks} blocks a layer, more "
                f"than the 2 GiB cache holds ({(2 << 30) // per_block})")
    if transparent_huge_pages() != "madvise":
        raise SystemExit(f"transparent huge pages are {transparent_huge_pages() or 'unknown'!r} here, not 'madvise': "
                         "both ways would be the same")
    from minibatch.kernels import cpu_decode

    cpu_decode.load()  # the build, before any timing
    load_before = machine_load()
    torch.set_num_threads(args.threads)
    rows = []
    for name, pool in (("twice the step's blocks", 2 * blocks), ("2 GiB", (2 << 30) // per_block)):
        row = {"cache": name, **kernel_times(args.requests, args.context, pool, args.repeats)}
        print(row)
        rows.append(row)
    engine = engine_times(args.requests, args.context, args.steps)
    print(engine)
    result = {"command": "python benchmarks/kv_huge_pages.py " + " ".join(argv if argv is not None
                                                                           else sys.argv[1:]),
              "environment": environment(load_before), "transparent_huge_pages": transparent_huge_pages(),
              "model": "smollm2-135m", "dtype": "bfloat16", "requests": args.requests, "context": args.context,
              "threads": args.threads, "kernel": rows, "engine": engine}
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
