"""The paged-attention Triton kernels (``minibatch.kernels``) against their torch references on one small
random paged cache: max absolute differences and call times, for notebook 04 and ``benchmarks/paged_kv.py``."""

from __future__ import annotations

import time

import torch


def kernel_check(seq_lens=(5, 11, 18), q_lens=(5, 1, 4), block_size: int = 4, num_heads: int = 4,
                 num_kv_heads: int = 2, head_dim: int = 16, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", seed: int = 0) -> dict:
    """Run the Triton kernels and their torch references on one small random paged cache.

    Requests with context lengths ``seq_lens`` hold shuffled, non-contiguous blocks. store_kv
    writes every context token's K/V (Triton into one cache, the reference into another);
    decode attention takes one query per request at its last position; prefill attention takes
    the last ``q_lens`` positions of each request as packed causal queries. Returns the max
    absolute differences (Triton - reference) and each call's time in ms ("timings_ms"; under
    TRITON_INTERPRET=1 the kernels run in numpy, orders of magnitude slower than on a GPU), or
    {"skipped": reason} when the kernels cannot run here. ``dtype`` may be float32, bfloat16 or float16,
    interpreted or compiled.
    """
    from minibatch import kernels

    if not kernels.HAS_TRITON or (torch.device(device).type != "cuda" and not kernels.IS_INTERPRETED):
        return {"skipped": "triton is not installed, or the kernels are compiled for a GPU"}
    g = torch.Generator().manual_seed(seed)
    num_blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(num_blocks_per_req) + 2  # two blocks nobody owns
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(k)] for k in num_blocks_per_req]
    block_tables = torch.zeros(len(seq_lens), max(num_blocks_per_req), dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    slot_mapping = torch.tensor([t[p // block_size] * block_size + p % block_size
                                 for t, n in zip(tables, seq_lens) for p in range(n)])  # (num_tokens,)
    num_tokens = len(slot_mapping)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g, dtype=dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g, dtype=dtype)
    cache_shape = (1, 2, num_blocks, block_size, num_kv_heads, head_dim)  # one layer
    cache, cache_ref = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    key, value, slot_mapping, block_tables, cache, cache_ref = to(key, value, slot_mapping, block_tables, cache,
                                                                  cache_ref)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    q_dec = torch.randn(len(seq_lens), num_heads, head_dim, generator=g, dtype=dtype).to(device)
    q_pre = torch.randn(sum(q_lens), num_heads, head_dim, generator=g, dtype=dtype).to(device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    calls = {
        "store_kv": (lambda: kernels.store_kv(cache, 0, key, value, slot_mapping),
                     lambda: kernels.store_kv_ref(cache_ref, 0, key, value, slot_mapping)),
        "decode": (lambda: kernels.paged_decode_attention(q_dec, cache_ref, 0, block_tables, seq, scale),
                   lambda: kernels.paged_decode_attention_ref(q_dec, cache_ref, 0, block_tables, seq, scale)),
        "prefill": (lambda: kernels.paged_prefill_attention(q_pre, cache_ref, 0, block_tables, seq, cu, scale),
                    lambda: kernels.paged_prefill_attention_ref(q_pre, cache_ref, 0, block_tables, seq, cu, scale)),
    }
    result = {"device": device, "interpreted": kernels.IS_INTERPRETED, "dtype": str(dtype).removeprefix("torch."),
              "seq_lens": list(seq_lens), "q_lens": list(q_lens), "block_size": block_size, "timings_ms": {}}
    for name, (triton_fn, ref_fn) in calls.items():  # store_kv first: the attention calls read cache_ref
        outs = []
        for label, fn in (("triton", triton_fn), ("ref", ref_fn)):
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs.append(fn())
            if device != "cpu":
                torch.cuda.synchronize()
            result["timings_ms"][f"{name}_{label}"] = 1e3 * (time.perf_counter() - t0)
        a, b = (cache, cache_ref) if name == "store_kv" else outs
        result[f"{name}_max_abs_diff"] = float((a.float() - b.float()).abs().max())
    return result
