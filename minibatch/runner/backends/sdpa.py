"""The ``sdpa`` attention backend: the paged KV cache read by whole blocks and attended with torch's fused
``scaled_dot_product_attention`` in the model's own dtype (its CPU and CUDA kernels accumulate bf16/fp16 in fp32).

What it saves over the ``torch`` reference, per layer (measured in ``python -m minibatch profile``):

* decodes gather K/V **by block** (``kv_cache[layer, 0][block_tables]``: one contiguous block_size x num_kv_heads
  x head_dim copy per table entry) instead of slot by slot, and never convert them to fp32;
* GQA shares K/V between query heads without copying them: the ``group`` query heads of a KV head are ``group``
  query rows against that head's keys;
* a prefill with nothing cached (num_computed_tokens == 0) attends to its own new K/V directly, causally, without
  reading the cache back;
* the new tokens' K/V are written with one ``index_copy_`` per K and V when no slot is -1 (the common case).

A sliding window is masked as transformers masks it (query i sees key j iff 0 <= i - j < window). The block-table
layout is vLLM's PagedAttention (Kwon et al., SOSP'23, §4.1); the fused attention is FlashAttention's tiling (Dao
et al., NeurIPS'22, §3.1) as torch implements it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minibatch.kernels.store_kv import store_kv_ref
from minibatch.runner.attention import AttentionMetadata
from minibatch.runner.backends.base import AttentionBackend, register_backend


@dataclass
class SdpaAttentionData:
    """The sdpa backend's per-step metadata. write_all: no slot_mapping entry is -1. decode_rows:
    (num_decodes,) int64, the decodes' query rows; decode_tables: (num_decodes, max_blocks) int64 block tables;
    decode_mask: (num_decodes, 1, 1, max_blocks x block_size) bool, True on real context. prefill_masks:
    request index -> (q_len, seq_len) bool causal mask for prefills that extend a cached context."""

    write_all: bool
    decode_rows: torch.Tensor | None = None
    decode_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefill_masks: dict | None = None
    prefill_spans: torch.Tensor | None = None  # (num_prefills, 4) int64, for a backend's own prefill kernel (cpp)
    prefill_tables: torch.Tensor | None = None  # (num_reqs, max_blocks) int64, contiguous, for that kernel
    decode_lens: torch.Tensor | None = None  # (num_decodes,) int64 seq_lens (kernels that mask by length read it)
    decode_groups: list | None = None  # a backend's own split of the decodes (compiled: by context length)


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    description = "fused scaled_dot_product_attention in the model's dtype, K/V gathered by block"
    sliding_window = True

    decode_mask = True  # whether decode() reads data.decode_mask (a kernel that masks by length does not)

    def prepare(self, m: AttentionMetadata) -> None:
        device, block_size = m.block_tables.device, m.kv_cache.shape[3]
        data = SdpaAttentionData(write_all=bool((m.slot_mapping >= 0).all()), prefill_masks={})
        if m.decode_indices:
            lens = [m.seq_lens[i] for i in m.decode_indices]
            num_blocks = -(-max(lens) // block_size)
            data.decode_rows = torch.tensor([m.cu_seqlens_q[i] for i in m.decode_indices], device=device)
            data.decode_lens = torch.tensor(lens, device=device)  # (num_decodes,) int64
            data.decode_tables = (m.block_tables  # an all-decode step: every row, every block
                                  if len(lens) == m.block_tables.shape[0] and num_blocks == m.block_tables.shape[1]
                                  else m.block_tables[m.decode_indices, :num_blocks])
            if self.decode_mask:
                positions = torch.arange(num_blocks * block_size, device=device)
                data.decode_mask = (positions[None, :] < data.decode_lens[:, None])[:, None, None, :]
        m.data = data
        if m.prefill_indices:
            self.prepare_prefills(m, data)

    def prepare_prefills(self, m: AttentionMetadata, data: SdpaAttentionData) -> None:
        """The prefills' part of :meth:`prepare` (a subclass with its own prefill kernel replaces it): the causal
        masks of the prefills that extend a cached context."""
        for i in m.prefill_indices:
            q_len, seq_len = m.cu_seqlens_q[i + 1] - m.cu_seqlens_q[i], m.seq_lens[i]
            if q_len < seq_len:  # extends a cached context: query t sees keys 0 .. seq_len - q_len + t
                data.prefill_masks[i] = causal_mask(q_len, seq_len, m.block_tables.device)

    def forward(self, m: AttentionMetadata, layer: int, q, k, v, scale: float, window: int | None) -> torch.Tensor:
        data: SdpaAttentionData = m.data
        _, _, num_blocks, block_size, h_kv, d = m.kv_cache.shape
        k_cache, v_cache = m.kv_cache[layer, 0], m.kv_cache[layer, 1]  # (num_blocks, block_size, h_kv, d)
        if data.write_all:
            k_cache.view(-1, h_kv, d).index_copy_(0, m.slot_mapping, k)
            v_cache.view(-1, h_kv, d).index_copy_(0, m.slot_mapping, v)
        else:
            store_kv_ref(m.kv_cache, layer, k, v, m.slot_mapping)
        if not m.prefill_indices:  # an all-decode step: no copy of q
            return self.decode(q, k_cache, v_cache, data, scale, window)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        self.prefill(m, layer, q, k, v, scale, window, out)
        if m.decode_indices:
            out[data.decode_rows] = self.decode(q[data.decode_rows], k_cache, v_cache, data, scale, window)
        return out

    def prefill(self, m: AttentionMetadata, layer: int, q, k, v, scale: float, window: int | None,
                out: torch.Tensor) -> None:
        """The prefills' attention, into their rows of ``out`` (their K/V already in the cache; a subclass may run
        its own kernel): ``causal_attention`` on the new tokens' own K/V, or on the context gathered from the cache
        with a mask when the prefill extends a cached context."""
        data: SdpaAttentionData = m.data
        block_size = m.kv_cache.shape[3]
        k_cache, v_cache = m.kv_cache[layer, 0], m.kv_cache[layer, 1]
        for i in m.prefill_indices:
            start, end, seq_len = m.cu_seqlens_q[i], m.cu_seqlens_q[i + 1], m.seq_lens[i]
            mask = data.prefill_masks.get(i)
            if window is not None and seq_len > window:
                mask = windowed(causal_mask(end - start, seq_len, q.device) if mask is None else mask, window)
            if mask is None:  # nothing cached: attend to the new tokens themselves
                out[start:end] = causal_attention(q[start:end], k[start:end], v[start:end], scale)
            else:
                blocks = m.block_tables[i, : -(-seq_len // block_size)]
                ctx_k = gather_blocks(k_cache, blocks[None])[0, :, :seq_len].transpose(0, 1)  # (seq_len, h_kv, d)
                ctx_v = gather_blocks(v_cache, blocks[None])[0, :, :seq_len].transpose(0, 1)
                out[start:end] = causal_attention(q[start:end], ctx_k, ctx_v, scale, mask)

    def decode(self, q, k_cache, v_cache, data: SdpaAttentionData, scale: float, window: int | None) -> torch.Tensor:
        """The one-token queries' attention (``decode_attention``; a subclass may run its own kernel)."""
        return decode_attention(q, k_cache, v_cache, data, scale, window)


def causal_mask(q_len: int, seq_len: int, device) -> torch.Tensor:
    """(q_len, seq_len) bool: the last q_len positions of a context each see keys up to their own position."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    return torch.arange(seq_len, device=device)[None, :] <= q_pos


def windowed(mask: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` (..., q_len, seq_len) for the last q_len positions, keeping only keys with i - j < window."""
    q_len, seq_len = mask.shape[-2:]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=mask.device)[:, None]
    return mask & (q_pos - torch.arange(seq_len, device=mask.device)[None, :] < window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """One request's attention in q's dtype. q: (q_len, num_heads, head_dim); k, v: (seq_len, num_kv_heads,
    head_dim). mask: (q_len, seq_len) bool, True = visible; None: seq_len == q_len and plain causal.
    Returns (q_len, num_heads, head_dim)."""
    # 4-d inputs (a batch of one): torch's CPU flash kernel takes those; 3-d ones fall back to the unfused math
    # path (measured: 5x slower on a 1024-token prefill)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The blocks of ``tables`` (n, max_blocks) int64 from ``cache`` (num_blocks, block_size, num_kv_heads,
    head_dim), as (n, num_kv_heads, max_blocks x block_size, head_dim) (a strided view of one new tensor).
    One ``index_select`` over blocks seen as rows: faster on a CPU than indexing the 4-d cache with ``cache[tables]``
    (``benchmarks/gather_blocks.py``: 0.18 vs 0.76 ms for the K and V of 32 tables of 17 blocks of SmolLM2's shape,
    bf16, 2 threads; ``data/cpu/gather_blocks.json``)."""
    num_blocks, block_size, h_kv, d = cache.shape
    n, max_blocks = tables.shape
    rows = cache.view(num_blocks, -1).index_select(0, tables.flatten())
    return rows.view(n, max_blocks * block_size, h_kv, d).transpose(1, 2)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, data: SdpaAttentionData,
                     scale: float, window: int | None = None) -> torch.Tensor:
    """All one-token queries in one call. q: (num_decodes, num_heads, head_dim); k_cache, v_cache: (num_blocks,
    block_size, num_kv_heads, head_dim); window: None or a sliding window (the last ``window`` keys of each
    context). Returns (num_decodes, num_heads, head_dim) in q's dtype."""
    n, num_heads, d = q.shape
    tables = data.decode_tables
    h_kv = k_cache.shape[2]
    k, v = gather_blocks(k_cache, tables), gather_blocks(v_cache, tables)  # (n, h_kv, max_blocks x block_size, d)
    qg = q.view(n, h_kv, num_heads // h_kv, d)  # GQA: a KV head's query heads are rows against its keys
    mask = data.decode_mask  # (n, 1, 1, max_blocks x block_size)
    if window is not None:
        seq_lens = mask.sum(-1, keepdim=True)
        mask = mask & (torch.arange(mask.shape[-1], device=mask.device) >= seq_lens - window)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(n, num_heads, d)


register_backend(SdpaBackend())
