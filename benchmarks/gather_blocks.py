"""How the ``sdpa`` backend reads a decode batch's K/V blocks: indexing the 4-d cache (``cache[tables]``) against one
``index_select`` over blocks seen as rows (``minibatch.runner.backends.sdpa.gather_blocks``), and the whole decode
attention of one layer with the new gather, on SmolLM2-135M's shapes (3 KV heads of 64, 9 query heads, block_size
16) in bf16.

    python benchmarks/gather_blocks.py --json data/cpu/gather_blocks.json

Both ways give the same tensor (checked); times are medians of ``--repeats`` calls, interleaved.
"""

from __future__ import annotations

import argparse
import sys

import torch

from minibatch.checks import MAX_TOKENS, OneLineParser, int_arg, output_file_arg
from minibatch.experiment import alternating_ms
from minibatch.report import environment, machine_load, write_json
from minibatch.runner.backends.sdpa import SdpaAttentionData, decode_attention, gather_blocks


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int_arg(1, 4096), default=32)
    p.add_argument("--context", type=int_arg(1, MAX_TOKENS), default=257, help="tokens in every request's context")
    p.add_argument("--threads", type=int_arg(1, 1024), default=2)
    p.add_argument("--repeats", type=int_arg(1, 100_000), default=50)
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    args = p.parse_args(argv)
    load_before = machine_load()
    torch.set_num_threads(args.threads)
    n, heads, kv_heads, d, block = args.requests, 9, 3, 64, 16
    blocks = -(-args.context // block)
    pool = n * blocks * 2
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(pool, block, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(pool, block, kv_heads, d, generator=g).bfloat16()
    tables = torch.randperm(pool, generator=g)[: n * blocks].view(n, blocks)
    q = torch.randn(n, heads, d, generator=g).bfloat16()
    mask = (torch.arange(blocks * block)[None, :] < torch.full((n, 1), args.context))[:, None, None, :]
    data = SdpaAttentionData(write_all=True, decode_tables=tables, decode_mask=mask)

    def indexed():  # the 4-d cache indexed by the tables, as the backend did before
        return (k_cache[tables].flatten(1, 2).transpose(1, 2), v_cache[tables].flatten(1, 2).transpose(1, 2))

    def selected():
        return gather_blocks(k_cache, tables), gather_blocks(v_cache, tables)

    assert all(torch.equal(a, b) for a, b in zip(indexed(), selected()))
    ways = {"indexed_4d_ms": indexed, "index_select_ms": selected,
            "decode_attention_ms": lambda: decode_attention(q, k_cache, v_cache, data, d ** -0.5)}
    times = alternating_ms(ways, args.repeats)
    result = {"command": "python benchmarks/gather_blocks.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": environment(load_before), "requests": n, "context": args.context, "threads": args.threads,
              "block_size": block, **{name: round(t, 3) for name, t in times.items()}}
    print({k: v for k, v in result.items() if k.endswith("_ms")})
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
