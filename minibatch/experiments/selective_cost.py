"""Tokens and FLOPs of one prefill forward, padded (B, T) vs packed (num_tokens,) (Orca, Yu et al. OSDI'22,
§3.2 selective batching), for notebook 03: counts from the prompt lengths and the model's sizes alone."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("padded", "packed", "packed, row mask")


@dataclass(frozen=True)
class ModelDims:
    """What the FLOP formula needs from a model.

    num_linear_params: weights of every matrix multiply a token goes through (q/k/v/o
        projections, MLP, LM head): the N of "2 * N FLOPs per token".
    num_layers: decoder layers. attn_dim: num_heads * head_dim (the width of Q, and of the
        attention output before the o projection).
    """

    num_linear_params: int
    num_layers: int
    attn_dim: int

    @classmethod
    def of(cls, model) -> "ModelDims":
        """Read them off an HF causal LM: N sums the weights of its ``nn.Linear`` modules (a tied
        LM head counts once, as the matrix multiply it is; the embedding lookup is no multiply)."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        return cls(linear, cfg.num_hidden_layers, cfg.num_attention_heads * head_dim)


@dataclass(frozen=True)
class ForwardCost:
    """Tokens and FLOPs of one prefill forward over prompts of lengths ``lens`` (see forward_cost)."""

    layout: str
    num_real_tokens: int
    num_computed_tokens: int
    num_attention_pairs: int
    linear_flops: int
    attention_flops: int

    @property
    def num_padding_tokens(self) -> int:
        return self.num_computed_tokens - self.num_real_tokens

    @property
    def total_flops(self) -> int:
        return self.linear_flops + self.attention_flops


def num_padding_tokens(lens: list[int]) -> int:
    """Padding tokens of a (B, T) batch of prompts of lengths ``lens``: B * max(lens) - sum(lens)."""
    return len(lens) * max(lens) - sum(lens)


def num_attention_pairs(lens: list[int], layout: str) -> int:
    """(query, key) scores one head of one layer computes in a prefill, with a *dense* kernel
    (SDPA with a mask computes every score of its matrix, masked or not):

    * "padded": B rows of T x T scores, T = max(lens): B * T^2;
    * "packed": the split; each request attends alone, L_i x L_i: sum of L_i^2;
    * "packed, row mask": one masked SDPA over the whole row, N x N with N = sum(lens).
    """
    if layout == "padded":
        return len(lens) * max(lens) ** 2
    if layout == "packed":
        return sum(n * n for n in lens)
    if layout == "packed, row mask":
        return sum(lens) ** 2
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def forward_cost(lens: list[int], dims: ModelDims, layout: str) -> ForwardCost:
    """FLOPs of one prefill forward of prompts ``lens`` (every computed token also gets logits):

        linear    = 2 * N * num_computed_tokens          (a multiply and an add per weight)
        attention = 4 * num_layers * attn_dim * num_pairs  (QK^T and PV: 2 * head_dim per pair and head)

    num_computed_tokens is B * max(lens) padded, sum(lens) packed. Norms, RoPE, softmax and
    activations are left out (a few FLOPs per element, not per weight).
    """
    computed = len(lens) * max(lens) if layout == "padded" else sum(lens)
    pairs = num_attention_pairs(lens, layout)
    return ForwardCost(layout, sum(lens), computed, pairs, 2 * dims.num_linear_params * computed,
                       4 * dims.num_layers * dims.attn_dim * pairs)
