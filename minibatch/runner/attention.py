"""Selective batching's attention: split the packed batch per request, attend, merge.

Orca §3.2 (selective batching): linear layers, norms and MLPs do not care which request a token
belongs to, so all scheduled tokens of all requests run packed as one (num_tokens, hidden)
matrix. Attention does care: each request's queries may only see that request's own keys. So
around attention we *split* the packed tokens per request, attend against the request's KV
cache, and *merge* the outputs back in order.

We hook this into the unmodified Hugging Face model through transformers' attention interface
(``AttentionInterface.register``): the model computes q, k, v (with RoPE) and calls our function
for every layer, passing through the ``attn_metadata`` keyword we gave its forward.

    packed row:  | req A: 5 prefill tokens | B: 1 decode | C: 3 prefill |
    cu_seqlens_q: 0                        5             6              9
    seq_lens:     5                        37            3          (context incl. new tokens)

Whatever else a model's attention module passes must not change the result: a sliding window is
applied (torch backend), every other option that would change it (softcap, attention sinks, ...)
is refused with NotImplementedError rather than ignored. Whether a model calls this function at
all is checked by running it (``runner.support``), once per model, when a ModelRunner is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The torch path's two building blocks are the kernels' own references (one implementation each):
# store_kv(kv_cache, layer, key, value, slot_mapping) scatters K/V to their slots (-1 skipped);
# reference_attention(q, k, v, scale) is causal GQA attention of the last q_len positions.
from minibatch.kernels.paged_attention import attention_ref as reference_attention
from minibatch.kernels.store_kv import store_kv_ref as store_kv

ATTN_IMPLEMENTATION = "minibatch_packed"
BACKENDS = ("torch", "triton")


@dataclass
class AttentionMetadata:
    """Everything attention needs for one packed step (built by ``runner.batch``).

    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim).
    slot_mapping: (num_tokens,) int64, the cache slot each new token's K/V is written to; -1 =
        do not write (padding).
    cu_seqlens_q: list of num_reqs + 1 offsets of each request's queries in the packed row.
    seq_lens: list of num_reqs context lengths (cached tokens + new tokens).
    backend: "torch" (the fields below gather K/V by slot) or "triton" (the kernels read the
        block tables: block_tables (num_reqs, max_blocks), seq_lens_tensor (num_reqs,) and
        cu_seqlens_q_tensor (num_reqs + 1,), all int32).
    context_slots: num_reqs int64 tensors (seq_len,), the cache slots of each request's context
        in position order (derived from its block_table).
    prefill_indices: indices (into the request list) of requests with several new tokens: one
        attention call each.
    decode_indices: indices of requests with exactly one new token. Their attention runs as one
        padded call instead of one call each (same math: padded keys are masked out);
        decode_rows: (num_decodes,) int64, their query rows in the packed batch.
    decode_slots: (num_decodes, max_seq_len) int64, each decode's context slots, right-padded
        with slot 0; decode_mask: (num_decodes, max_seq_len) bool, True on real context.
    probe_calls: None, or a list the attention function appends each call's layer_idx to (the
        support check's proof that the model really dispatched to it, ``runner.support``).
    """

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: list[int]
    seq_lens: list[int]
    prefill_indices: list[int]
    decode_indices: list[int]
    backend: str = "torch"
    block_tables: torch.Tensor | None = None
    seq_lens_tensor: torch.Tensor | None = None
    cu_seqlens_q_tensor: torch.Tensor | None = None
    context_slots: list[torch.Tensor] | None = None
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    probe_calls: list[int] | None = None


# Keyword arguments transformers' attention modules pass that do not change the attention itself:
# positions are already applied to q/k (RoPE) or to the embeddings, and cache, router and output flags
# are the model's business (output_attentions gets no weights back). Found by recording what the
# architectures of minibatch/architectures.py pass (transformers 5.17 and 5.24).
IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions",
                            "output_router_logits", "output_hidden_states", "return_dict"})
# Options that are plain causal attention at these values (or None); any other value is refused.
NEUTRAL_KWARGS = {"is_causal": True, "dropout": 0.0}


class MissingAttnMetadata(ValueError):
    """The packed attention was called without ``attn_metadata`` (the model call lacked it, or the
    model's layers do not pass their keyword arguments through to attention)."""


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_metadata: AttentionMetadata | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered with transformers' AttentionInterface.

    query: (1, num_heads, num_tokens, head_dim); key, value: (1, num_kv_heads, num_tokens, head_dim).
    Returns (1, num_tokens, num_heads, head_dim), as transformers' attention functions do.
    attention_mask is not read: every request's causal mask comes from attn_metadata.
    sliding_window: a query at position i sees key j iff i - j < sliding_window (transformers'
    sliding-window mask); the triton backend supports it only while no context is longer.

    Raises:
        MissingAttnMetadata (a ValueError): attn_metadata is None.
        NotImplementedError: a keyword argument this function does not implement, at a value that
            changes the attention (softcap, attention sinks ``s_aux``, dropout > 0, is_causal=False,
            anything not in IGNORED_KWARGS); a module without ``layer_idx``; a sliding window
            shorter than a context on the triton backend.
    """
    cls = type(module).__name__
    if attn_metadata is None:
        raise MissingAttnMetadata(f"attention '{ATTN_IMPLEMENTATION}' got no attn_metadata in {cls}: "
                                  "pass attn_metadata= in the model call (ModelRunner does)")
    options = dict(kwargs, dropout=dropout)
    for name, setting in options.items():  # never attend wrongly in silence
        if name in IGNORED_KWARGS or setting is None or (name in NEUTRAL_KWARGS and setting == NEUTRAL_KWARGS[name]):
            continue
        shown = f"a tensor of shape {tuple(setting.shape)}" if torch.is_tensor(setting) else repr(setting)
        raise NotImplementedError(f"packed attention does not support {name}={shown} (attention module {cls})")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise NotImplementedError(f"attention module {cls} has no layer_idx: the packed KV cache needs it")
    m = attn_metadata
    if m.probe_calls is not None:
        m.probe_calls.append(layer)
    q = query[0].transpose(0, 1)  # (num_tokens, num_heads, head_dim)
    k = key[0].transpose(0, 1)  # (num_tokens, num_kv_heads, head_dim)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = sliding_window if sliding_window is not None and max(m.seq_lens) > sliding_window else None
    if m.backend == "triton":
        if window is not None:
            raise NotImplementedError(f"the triton backend has no sliding window: contexts of up to {max(m.seq_lens)} "
                                      f"tokens exceed sliding_window={sliding_window} (attention module {cls}); "
                                      "use attention_backend='torch'")
        return _triton_attention(m, layer, q, k, v, scale).unsqueeze(0), None
    store_kv(m.kv_cache, layer, k, v, m.slot_mapping)
    _, _, num_blocks, block_size, h_kv, d = m.kv_cache.shape
    k_flat = m.kv_cache[layer, 0].view(num_blocks * block_size, h_kv, d)
    v_flat = m.kv_cache[layer, 1].view(num_blocks * block_size, h_kv, d)
    out = torch.empty_like(q)
    for i in m.prefill_indices:  # split ...
        start, end, slots = m.cu_seqlens_q[i], m.cu_seqlens_q[i + 1], m.context_slots[i]
        if window is None:
            out[start:end] = reference_attention(q[start:end], k_flat[slots], v_flat[slots], scale)  # ... and merge
        else:
            out[start:end] = sliding_window_attention(q[start:end], k_flat[slots], v_flat[slots], scale, window)
    if m.decode_indices:
        rows, mask = m.decode_rows, m.decode_mask
        if window is not None:  # keep the last `window` positions of each context: i - j < window
            seq_lens = mask.sum(-1, keepdim=True)  # (num_decodes, 1)
            mask = mask & (torch.arange(mask.shape[1], device=mask.device)[None, :] >= seq_lens - window)
        out[rows] = batched_decode_attention(q[rows], k_flat, v_flat, m.decode_slots, mask, scale)
    return out.unsqueeze(0), None


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


def _triton_attention(m: AttentionMetadata, layer: int, q, k, v, scale: float) -> torch.Tensor:
    """The same step with the Triton kernels: scatter K/V by slot_mapping, then paged attention
    reading the cache through the block tables. An all-decode step uses the decode kernel;
    a step with any prefill runs every request through the prefill kernel (q_len 1 included)."""
    from minibatch import kernels

    kernels.store_kv(m.kv_cache, layer, k, v, m.slot_mapping)
    if not m.prefill_indices:
        return kernels.paged_decode_attention(q, m.kv_cache, layer, m.block_tables, m.seq_lens_tensor, scale)
    max_q_len = max(b - a for a, b in zip(m.cu_seqlens_q, m.cu_seqlens_q[1:]))
    return kernels.paged_prefill_attention(q, m.kv_cache, layer, m.block_tables, m.seq_lens_tensor,
                                           m.cu_seqlens_q_tensor, scale, max_q_len)


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


def register() -> str:
    """Register the packed attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention_forward)
    return ATTN_IMPLEMENTATION
