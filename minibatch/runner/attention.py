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

The attention itself is an attention backend's (``runner.backends``: the torch reference, the Triton kernels,
or one registered by name); this function checks the call and dispatches. Whatever else a model's attention
module passes must not change the result: a sliding window is applied (by a backend that supports one), every
other option that would change it (softcap, attention sinks, ...)
is refused with NotImplementedError rather than ignored. Whether a model calls this function at
all is checked by running it (``runner.support``), once per model, when a ModelRunner is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTN_IMPLEMENTATION = "minibatch_packed"


@dataclass
class AttentionMetadata:
    """What every attention backend gets for one packed step (built once per step by ``runner.batch``).

    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim).
    slot_mapping: (num_tokens,) int64, the cache slot each new token's K/V is written to; -1 =
        do not write (padding).
    cu_seqlens_q: list of num_reqs + 1 offsets of each request's queries in the packed row.
    seq_lens: list of num_reqs context lengths (cached tokens + new tokens).
    block_tables: (num_reqs, max_blocks) int64, each request's block_table cut to its seq_len, padded with 0.
    prefill_indices: indices (into the request list) of requests with several new tokens.
    decode_indices: indices of requests with exactly one new token.
    backend: the AttentionBackend that runs the step (``runner.backends``); data: its own metadata, set by
        ``backend.prepare`` (e.g. the torch reference's gathered context slots, the Triton kernels' int32 tables).
    probe_calls: None, or a list the attention function appends each call's layer_idx to (the
        support check's proof that the model really dispatched to it, ``runner.support``).
    """

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    prefill_indices: list[int]
    decode_indices: list[int]
    backend: object = None
    data: object = None
    probe_calls: list[int] | None = None


def context_slots(block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> torch.Tensor:
    """(num_reqs, max_seq_len) int64: the cache slot of every context position of every request, from its
    (num_reqs, max_blocks) block table; positions at or past a request's seq_len hold slot 0 (mask them)."""
    pos = torch.arange(max(seq_lens), device=block_tables.device)
    slots = block_tables[:, pos // block_size] * block_size + pos % block_size  # (num_reqs, max_seq_len)
    lens = torch.tensor(seq_lens, device=block_tables.device)
    return slots.masked_fill(pos[None, :] >= lens[:, None], 0)


# Keyword arguments transformers' attention modules pass that do not change the attention itself:
# positions are already applied to q/k (RoPE) or to the embeddings, and cache, router and output flags
# are the model's business (output_attentions gets no weights back). Found by recording what the
# architectures of tests/architectures.py pass (transformers 5.17 and 5.24).
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
    sliding-window mask), where the backend supports one (else only while no context is longer).

    Raises:
        MissingAttnMetadata (a ValueError): attn_metadata is None.
        NotImplementedError: a keyword argument this function does not implement, at a value that
            changes the attention (softcap, attention sinks ``s_aux``, dropout > 0, is_causal=False,
            anything not in IGNORED_KWARGS); a module without ``layer_idx``; a sliding window
            shorter than a context on a backend without sliding-window support.
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
    if window is not None and not m.backend.sliding_window:
        raise NotImplementedError(f"attention backend {m.backend.name!r} has no sliding window: contexts of up to "
                                  f"{max(m.seq_lens)} tokens exceed sliding_window={sliding_window} (attention module "
                                  f"{cls}); use attention_backend='torch'")
    return m.backend.forward(m, layer, q, k, v, scale, window).unsqueeze(0), None


def register() -> str:
    """Register the packed attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention_forward)
    return ATTN_IMPLEMENTATION
