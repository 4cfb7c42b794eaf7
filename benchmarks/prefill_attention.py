"""One layer's prefill attention in bf16 (or float32, ``--dtype float32``) on SmolLM2-135M's shapes (9 query
heads, 3 KV heads of 64, block_size 16): the ``sdpa`` backend's prefill path (torch's fused attention on the new
tokens' own K/V, or on the context gathered from the cache with a mask when a chunk extends a cached context)
against the ``cpp`` backend's paged prefill kernel (``minibatch.kernels.cpu_prefill``), both through the backends'
own ``prefill`` methods, after the new tokens' K/V are in the cache.

    python benchmarks/prefill_attention.py --json data/cpu/prefill_attention.json
    python benchmarks/prefill_attention.py --dtype float32 --json data/cpu/prefill_attention_float32.json

and, for the float32 path at AVX2's width on a CPU with AVX-512 (what laptops without AVX-512 run), the float32
command with ``--kernel-cflags=-mno-avx512f --json data/cpu/prefill_attention_float32_avx2.json``.
``--against-rev REV`` adds a third way, "cpp_REV": the kernel built from the C++ sources at git revision REV, called
through the same backend (an A/B of a kernel change in one process).

Cases: one prompt of 256, 1024 and 2048 tokens with nothing cached; a 512-token chunk after 1536 cached tokens
(chunked prefill); 8 prompts of 128 tokens in one step. Times are medians of ``--repeats`` calls, taking turns;
GFLOP/s counts the causal attention's multiply-adds (4 x head_dim per visible query-key pair and head). The outputs
are checked against each other first (bf16: within 2e-2; float32: 1e-4). bf16 needs a CPU with AVX512-BF16,
float32 one with AVX2 and FMA or AVX-512 (else the kernel has no path for the dtype and the script says so).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from fused_layers import commit_arg, kernel_sources_at
from minibatch.checks import OneLineParser, int_arg, output_file_arg
from minibatch.experiment import alternating_ms
from minibatch.kernels import cpp_build, cpu_prefill
from minibatch.report import environment, machine_load, write_json
from minibatch.runner.attention import AttentionMetadata
from minibatch.runner.backends.base import get_backend

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = {"prompt_256": [(0, 256)], "prompt_1024": [(0, 1024)], "prompt_2048": [(0, 2048)],
         "chunk_512_after_1536": [(1536, 512)], "8_prompts_of_128": [(0, 128)] * 8}  # (cached, new) per prefill


def metadata(spans, g, dtype=torch.bfloat16) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-layer step of prefills (cached, new) with random K/V already in a random paged cache, and q, k, v."""
    blocks = [-(-(c + n) // BLOCK) for c, n in spans]
    pool = sum(blocks) + 1
    kv = torch.randn(1, 2, pool, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    order = torch.randperm(pool, generator=g)
    tables = torch.zeros(len(spans), max(blocks), dtype=torch.long)
    cu, at = [0], 0
    for i, b in enumerate(blocks):
        tables[i, :b] = order[at:at + b]
        at += b
        cu.append(cu[-1] + spans[i][1])
    slots = torch.cat([tables[i, torch.arange(c, c + n) // BLOCK] * BLOCK + torch.arange(c, c + n) % BLOCK
                       for i, (c, n) in enumerate(spans)])
    m = AttentionMetadata(kv, slots, cu, [c + n for c, n in spans], tables, list(range(len(spans))), [])
    k = kv[0, 0].view(-1, KV_HEADS, HEAD_DIM)[slots].clone()  # the new tokens' K/V, as the layer made them
    v = kv[0, 1].view(-1, KV_HEADS, HEAD_DIM)[slots].clone()
    q = (3 * torch.randn(cu[-1], HEADS, HEAD_DIM, generator=g)).to(dtype)
    return m, q, k, v


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int_arg(1, 1024), default=2)
    p.add_argument("--repeats", type=int_arg(1, 100_000), default=20)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--kernel-cflags", default="", help="extra compiler flags for the kernel, e.g. -mno-avx512f: "
                   "the float32 path at AVX2's width (8 lanes, 16 registers, as on laptops) on an AVX-512 CPU")
    p.add_argument("--against-rev", type=commit_arg, default=None, help="also time the kernel at this git revision")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    cflags = tuple(args.kernel_cflags.split())
    if args.kernel_cflags:
        cpu_prefill.KERNEL.module = cpp_build.build(cpu_prefill.SOURCE, cflags)
    ways = {"sdpa": None, "cpp": cpu_prefill.KERNEL.load() if cpu_prefill.KERNEL.available() else None}
    if args.against_rev:
        folder = kernel_sources_at(args.against_rev, "prefill")
        ways[f"cpp_{args.against_rev}"] = cpp_build.build(os.path.join(folder, os.path.basename(cpu_prefill.SOURCE)),
                                                          cflags)
    if not cpu_prefill.available(dtype):
        raise SystemExit(f"the paged prefill kernel has no {args.dtype} path here (bf16 needs AVX512-BF16, float32 "
                         "AVX2 with FMA or AVX-512, both a C++ compiler)")
    load_before = machine_load()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    scale = HEAD_DIM ** -0.5
    rows = []
    for name, spans in CASES.items():
        m, q, k, v = metadata(spans, g, dtype)
        outs = {}
        calls = {}
        for way, module in ways.items():
            b = get_backend("sdpa" if way == "sdpa" else "cpp")
            meta = AttentionMetadata(**{**m.__dict__, "data": None})
            b.prepare(meta)
            out = outs[way] = torch.empty_like(q)

            def call(b=b, meta=meta, out=out, module=module):
                today, cpu_prefill.KERNEL.module = cpu_prefill.KERNEL.module, module or cpu_prefill.KERNEL.module
                try:
                    b.prefill(meta, 0, q, k, v, scale, None, out)
                finally:
                    cpu_prefill.KERNEL.module = today
            calls[f"{way}_ms"] = call
            call()
        err = max((outs["sdpa"].float() - o.float()).abs().max().item() for o in outs.values())
        assert err <= (2e-2 if dtype == torch.bfloat16 else 1e-4), (name, err)
        times = alternating_ms(calls, args.repeats)
        flops = sum(4 * HEAD_DIM * HEADS * (n * c + n * (n + 1) // 2) for c, n in spans)
        row = {"case": name, "prefills": [list(s) for s in spans], "max_abs_diff": round(err, 5),
               **{k: round(t, 3) for k, t in times.items()},
               "gflop_per_s": {w: round(flops / times[f"{w}_ms"] / 1e6, 1) for w in ways},
               "speedup": round(times["sdpa_ms"] / times["cpp_ms"], 2)}
        if args.against_rev:
            row[f"speedup_over_{args.against_rev}"] = round(times[f"cpp_{args.against_rev}_ms"] / times["cpp_ms"], 2)
        print(row)
        rows.append(row)
    result = {"command": "python benchmarks/prefill_attention.py " + " ".join(argv if argv is not None
                                                                               else sys.argv[1:]),
              "environment": environment(load_before), "threads": args.threads, "dtype": args.dtype,
              "kernel_cflags": args.kernel_cflags, "against_rev": args.against_rev,
              "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK, "rows": rows}
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
