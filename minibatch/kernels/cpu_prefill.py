"""A CPU paged prefill-attention kernel (``cpu_paged_prefill.cpp``), built on first use: bf16 on CPUs with
AVX512-BF16, float32 on CPUs with AVX2 and FMA or AVX-512.

Why: torch's CPU flash attention (what the ``sdpa`` backend calls for a prefill) ran a 1024-token prefill's
attention at about a quarter of the bf16 matrix products' rate on a 2-core AVX512-BF16 CPU, and a chunk that
extends a cached context first copies the context out of the paged cache and builds a mask. This kernel
reads every position, cached or new, through the block table, and runs both products of FlashAttention's tiling
(Dao et al., NeurIPS'22, §3.1) on VDPBF16PS, bf16 pairs into float32 sums (on CPUs with AMX and head_dim a
multiple of 32, on its tiles: ``data/cpu/prefill_attention_amx.json``); the softmax's weights are rounded to bf16
for the product with V, as torch's CPU flash attention does for bf16 inputs (``benchmarks/prefill_attention.py``,
``data/cpu/prefill_attention.json``). In float32 the same tiling runs on fused multiply-adds over the machine's
vector lanes, the weights kept in float32 (``data/cpu/prefill_attention_float32.json``). The ``cpp`` backend uses it
for prefills in every dtype it is :func:`available` for.
"""

from __future__ import annotations

import os

import torch

from minibatch.kernels.cpp_build import CppExtension
from minibatch.kernels.cpu_bf16_linear import cpu_has_avx512_bf16

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_paged_prefill.cpp")
KERNEL = CppExtension(SOURCE, "the C++ paged prefill kernel")
DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}  # the dtypes it has a path for


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernel runs ``dtype`` here (built on the first call): bf16 on a CPU that reports AVX512-BF16,
    float32 on one with AVX2 and FMA or AVX-512."""
    if dtype not in DTYPES or not KERNEL.available():
        return False
    return (dtype != torch.bfloat16 or cpu_has_avx512_bf16()) and bool(KERNEL.load().prefill_available(DTYPES[dtype]))


def supports(kv_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_prefill` takes a model with this KV cache (any layout whose last dimension is head_dim):
    bf16 or float32 on the CPU, head_dim a multiple of 16 up to 256, and :func:`available` in its dtype."""
    hd = kv_cache.shape[-1]
    return kv_cache.device.type == "cpu" and hd % 16 == 0 and hd <= 256 and available(kv_cache.dtype)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  spans: torch.Tensor, scale: float, window: int | None, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of the prefills in ``spans`` over the paged cache, written into ``out``'s rows.

    q, out: (T, num_heads, head_dim) bf16 or float32, contiguous; k_cache, v_cache: (num_blocks, block_size,
    num_kv_heads, head_dim) in q's dtype, contiguous, already holding every position's K/V (the new tokens' too);
    tables: (N, max_blocks) int64; spans: (P, 4) int64, one row [q_start, q_len, seq_len, table_row] per prefill:
    its q_len query rows from q_start are its context's last q_len positions (seq_len >= q_len), and see keys [0,
    position] read through ``tables[table_row]``; window: None or a sliding window (the last ``window`` of those
    keys).
    Rows of ``out`` outside the spans are left as they are. Returns ``out``. Named ``minibatch::paged_prefill`` in
    torch's profiler.

    Raises:
        RuntimeError: the kernel could not be built, it has no path for q's dtype on this CPU (:func:`available`),
            or the inputs break the contract (the C++ check's message names what)."""
    KERNEL.load().paged_prefill(q, k_cache, v_cache, tables, spans, float(scale), int(window or 0), out)
    return out
