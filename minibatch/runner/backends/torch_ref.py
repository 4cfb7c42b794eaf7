"""The reference attention backend, ``torch``: gather each request's K/V from the paged cache by slot and attend
with plain torch (fp32 scores and softmax). Every other backend is tested against it.

A prefill request (several new tokens) runs one causal GQA attention over its gathered context; all decode
requests (one new token each) run as one padded, masked scaled_dot_product_attention call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# its two building blocks are the kernels' own references (one implementation each):
# store_kv(kv_cache, layer, key, value, slot_mapping) scatters K/V to their slots (-1 skipped);
# reference_attention(q, k, v, scale) is causal GQA attention of the last q_len positions.
from minibatch.kernels.paged_attention import attention_ref as reference_attention
from minibatch.kernels.store_kv import store_kv_ref as store_kv
from minibatch.runner.attention import AttentionMetadata, context_slots
from minibatch.runner.backends.base import AttentionBackend, register_backend


@dataclass
class TorchAttentionData:
    """The torch backend's metadata. context_slots: num_reqs int64 tensors (seq_len,), the cache slots of each
    request's context in position order. decode_rows: (num_decodes,) int64, the decodes' query rows in the packed
    batch; decode_slots: (num_decodes, max_seq_len) int64, their context slots right-padded with slot 0;
    decode_mask: (num_decodes, max_seq_len) bool, True on real context (None: no decodes)."""

    context_slots: list[torch.Tensor]
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None


class TorchBackend(AttentionBackend):
    name = "torch"
    description = "reference: gather K/V by slot, scaled_dot_product_attention in fp32"
    sliding_window = True

    def prepare(self, m: AttentionMetadata) -> None:
        ctx = context_slots(m.block_tables, m.seq_lens, m.kv_cache.shape[3])  # (num_reqs, max_seq_len)
        data = TorchAttentionData([ctx[i, :n] for i, n in enumerate(m.seq_lens)])
        if m.decode_indices:  # the decodes' rows of the table, right-padded, and which entries are real
            device = ctx.device
            max_len = max(m.seq_lens[i] for i in m.decode_indices)
            data.decode_rows = torch.tensor([m.cu_seqlens_q[i] for i in m.decode_indices], device=device)
            data.decode_slots = ctx[m.decode_indices, :max_len]
            data.decode_mask = torch.arange(max_len, device=device)[None, :] < torch.tensor(
                [m.seq_lens[i] for i in m.decode_indices], device=device)[:, None]
        m.data = data

    def forward(self, m: AttentionMetadata, layer: int, q, k, v, scale: float, window: int | None) -> torch.Tensor:
        store_kv(m.kv_cache, layer, k, v, m.slot_mapping)
        _, _, num_blocks, block_size, h_kv, d = m.kv_cache.shape
        k_flat = m.kv_cache[layer, 0].view(num_blocks * block_size, h_kv, d)
        v_flat = m.kv_cache[layer, 1].view(num_blocks * block_size, h_kv, d)
        data: TorchAttentionData = m.data
        out = torch.empty_like(q)
        for i in m.prefill_indices:  # split ...
            start, end, slots = m.cu_seqlens_q[i], m.cu_seqlens_q[i + 1], data.context_slots[i]
            if window is None:
                out[start:end] = reference_attention(q[start:end], k_flat[slots], v_flat[slots], scale)  # ... merge
            else:
                out[start:end] = sliding_window_attention(q[start:end], k_flat[slots], v_flat[slots], scale, window)
        if m.decode_indices:
            rows, mask = data.decode_rows, data.decode_mask
            if window is not None:  # keep the last `window` positions of each context: i - j < window
                seq_lens = mask.sum(-1, keepdim=True)  # (num_decodes, 1)
                mask = mask & (torch.arange(mask.shape[1], device=mask.device)[None, :] >= seq_lens - window)
            out[rows] = batched_decode_attention(q[rows], k_flat, v_flat, data.decode_slots, mask, scale)
        return out


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             window: int) -> torch.Tensor:
    """``reference_attention`` where the query at position i sees key j iff 0 <= i - j < window.

    q: (q_len, num_heads, head_dim), the last q_len positions of the context; k, v: (seq_len,
    num_kv_heads, head_dim). Returns (q_len, num_heads, head_dim) in q's dtype (computed in fp32).

        window 3, seq_len 6, q_len 2:   key j  0 1 2 3 4 5
                              query i=4        . . x x x .
                              query i=5        . . . x x x
    """
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)  # (seq_len, num_heads, head_dim): GQA heads share K/V
    v = v.float().repeat_interleave(group, dim=1)
    i = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]  # (q_len, 1) query positions
    j = torch.arange(seq_len, device=q.device)[None, :]  # (1, seq_len) key positions
    mask = (j <= i) & (i - j < window)  # (q_len, seq_len), True = visible
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)  # (num_heads, q_len, head_dim)
    return out.transpose(0, 1).to(q.dtype)


def batched_decode_attention(
    q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """All one-token (decode) queries in one call, contexts right-padded and masked.

    q: (num_decodes, num_heads, head_dim); k_flat, v_flat: (num_slots, num_kv_heads, head_dim);
    slots, mask: (num_decodes, max_seq_len). Returns (num_decodes, num_heads, head_dim) in q's dtype,
    computed in fp32 (bf16/fp16 K/V are converted after the gather, so scores and softmax are fp32).
    GQA without copying K/V: the `group` query heads sharing a KV head become `group` query rows
    against that head's keys.
    """
    b, num_heads, d = q.shape
    num_kv_heads = k_flat.shape[1]
    group = num_heads // num_kv_heads
    k = k_flat[slots].transpose(1, 2).float()  # (num_decodes, num_kv_heads, max_seq_len, head_dim)
    v = v_flat[slots].transpose(1, 2).float()
    qg = q.float().view(b, num_kv_heads, group, d)  # (num_decodes, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(b, num_heads, d).to(q.dtype)


register_backend(TorchBackend())
