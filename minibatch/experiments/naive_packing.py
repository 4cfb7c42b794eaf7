"""Naive packing, for notebook 03: the packed row of prompts through a model with ONE attention over the
whole row, as if it were one sequence (every token also sees the earlier requests' tokens), and the
block-diagonal causal mask that repairs it; the greedy loop that shows what it does to the tokens."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from minibatch.models import attention_implementation

ROW_ATTENTION = "minibatch_row_sdpa"


def causal_mask(num_tokens: int) -> torch.Tensor:
    """(num_tokens, num_tokens) bool, True = query row may see key column: key <= query."""
    return torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()


def block_diagonal_causal_mask(seq_lens: list[int]) -> torch.Tensor:
    """(N, N) bool for a packed row of prefills, N = sum(seq_lens): query i sees key j iff both
    belong to the same request and j <= i. The causal mask restricted to the diagonal blocks.

        seq_lens [2, 1, 3]:   1 . . . . .
                              1 1 . . . .
                              . . 1 . . .
                              . . . 1 . .
                              . . . 1 1 .
                              . . . 1 1 1
    """
    request = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))  # (N,) request of each token
    return causal_mask(len(request)) & (request[:, None] == request[None, :])


def row_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          row_mask: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention over the whole packed row as if it were ONE sequence (registered as ROW_ATTENTION).

    query: (1, num_heads, N, head_dim); key, value: (1, num_kv_heads, N, head_dim).
    row_mask: (N, N) bool, True = may attend; None = plain causal (the naive packing: every token
    also sees the earlier requests' tokens). Returns (1, N, num_heads, head_dim).
    """
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1)  # (1, num_heads, N, head_dim): GQA, each KV head shared by `group`
    v = value.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=row_mask, is_causal=row_mask is None,
                                         scale=scaling)  # (1, num_heads, N, head_dim)
    return out.transpose(1, 2), None


def register_row_attention() -> str:
    """Register :func:`row_attention_forward` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ROW_ATTENTION, row_attention_forward)
    return ROW_ATTENTION


def packed_inputs(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and positions (num_tokens,) of prompts packed in one row; positions restart at 0
    for every request (RoPE sees each token at its own position in its own request)."""
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    return ids, positions


@torch.inference_mode()
def row_forward(model, prompts: list[list[int]], row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The packed row of ``prompts`` through ``model`` with attention over the whole row (see
    :func:`row_attention_forward`; ``row_mask`` None = naive causal). Linear layers are the
    same packed matmuls as selective batching; only attention differs.
    Returns logits (num_tokens, vocab_size)."""
    ids, positions = packed_inputs(prompts)
    register_row_attention()
    with attention_implementation(model, ROW_ATTENTION):
        return model(input_ids=ids[None], position_ids=positions[None], row_mask=row_mask,
                     use_cache=False).logits[0]  # (num_tokens, vocab_size)


def last_token_rows(lens: list[int]) -> list[int]:
    """Packed index of each request's last token: cu_seqlens_q[1:] - 1."""
    ends, total = [], 0
    for n in lens:
        total += n
        ends.append(total - 1)
    return ends


def per_request_max_diff(a: torch.Tensor, b: torch.Tensor, lens: list[int]) -> list[float]:
    """max |a - b| over each request's rows of two (num_tokens, V) packed tensors."""
    out, start = [], 0
    for n in lens:
        out.append(float((a[start:start + n] - b[start:start + n]).abs().max()))
        start += n
    return out


def greedy(logits_fn: Callable[[list[list[int]]], torch.Tensor], prompts: list[list[int]],
           num_new_tokens: int) -> list[list[int]]:
    """Greedy-generate ``num_new_tokens`` for every prompt, recomputing the whole packed row each
    step (no KV cache: the simplest loop that shows what attention does to the tokens).

    logits_fn(sequences) -> (num_tokens, vocab_size) logits of the sequences packed in one row.
    Returns the generated tokens of each prompt.
    """
    seqs = [list(p) for p in prompts]
    for _ in range(num_new_tokens):
        logits = logits_fn(seqs)
        for seq, row in zip(seqs, last_token_rows([len(s) for s in seqs])):
            seq.append(int(logits[row].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts)]
