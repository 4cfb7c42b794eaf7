"""A CPU paged prefill-attention kernel for bf16 with AVX512-BF16 (``cpu_paged_prefill.cpp``), built on first use.

Why: torch's CPU flash attention (what the ``sdpa`` backend calls for a prefill) ran a 1024-token prefill's
attention at about a quarter of the bf16 matrix products' rate on a 2-core AVX512-BF16 CPU, and a chunk that
extends a cached context first copies the context out of the paged cache and builds a mask. This kernel
reads every position, cached or new, through the block table, and runs both products of FlashAttention's tiling
(Dao et al., NeurIPS'22, §3.1) on VDPBF16PS, bf16 pairs into float32 sums; the softmax's weights are rounded to bf16
for the product with V, as torch's CPU flash attention does for bf16 inputs (``benchmarks/prefill_attention.py``,
``data/cpu/prefill_attention.json``). The ``cpp`` backend uses it for bf16 prefills where :func:`available`.
"""

from __future__ import annotations

import os

import torch

from minibatch.kernels.cpp_build import CppExtension
from minibatch.kernels.cpu_bf16_linear import cpu_has_avx512_bf16

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_paged_prefill.cpp")
KERNEL = CppExtension(SOURCE, "the C++ paged prefill kernel")


def available() -> bool:
    """Whether this CPU reports AVX512-BF16 and the kernel builds and runs it here (built on the first call)."""
    return cpu_has_avx512_bf16() and KERNEL.available() and bool(KERNEL.load().prefill_available())


def supports(kv_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_prefill` takes a model with this KV cache (any layout whose last dimension is head_dim):
    bf16 on the CPU, head_dim a multiple of 16 up to 256, and :func:`available`."""
    hd = kv_cache.shape[-1]
    return kv_cache.dtype == torch.bfloat16 and kv_cache.device.type == "cpu" and hd % 16 == 0 and hd <= 256 \
        and available()


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  spans: torch.Tensor, scale: float, window: int | None, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of the prefills in ``spans`` over the paged cache, written into ``out``'s rows.

    q, out: (T, num_heads, head_dim) bf16, contiguous; k_cache, v_cache: (num_blocks, block_size, num_kv_heads,
    head_dim) bf16, contiguous, already holding every position's K/V (the new tokens' too); tables: (N,
    max_blocks) int64; spans: (P, 4) int64, one row [q_start, q_len, seq_len, table_row] per prefill: its q_len
    query rows from q_start are its context's last q_len positions (seq_len >= q_len), and see keys [0, position]
    read through ``tables[table_row]``; window: None or a sliding window (the last ``window`` of those keys).
    Rows of ``out`` outside the spans are left as they are. Returns ``out``. Named ``minibatch::paged_prefill`` in
    torch's profiler.

    Raises:
        RuntimeError: the kernel could not be built, this CPU has no AVX512-BF16, or the inputs break the contract
            (the C++ check's message names what)."""
    KERNEL.load().paged_prefill(q, k_cache, v_cache, tables, spans, float(scale), int(window or 0), out)
    return out
