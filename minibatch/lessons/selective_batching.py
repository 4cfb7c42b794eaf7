"""Notebook 03 (selective batching): printers, the mask exercise's check, and the names the notebook and
the tests import from here.

Orca (Yu et al., OSDI'22) §3.2, *selective batching*: the linear layers (QKV and output
projections, MLP, LM head) and the norms treat every token alike, so the tokens of all requests
in a step run *packed* as one (num_tokens, hidden) matrix, with no padding. Attention is the one
operation where a token must see only its own request's keys, so around attention the packed
tokens are *split* per request, attend against that request's KV cache, and are *merged* back.
Our implementation is ``minibatch/runner/batch.py`` (the packed tensors and ``cu_seqlens_q`` /
``seq_lens`` / ``slot_mapping``), ``minibatch/runner/attention.py`` (the attention function the model calls) and
``minibatch/runner/backends/torch_ref.py`` (the split and merge of the reference attention backend).

The rest lives in ``minibatch.experiments``: ``selective_cost`` (token and FLOP counts of a padded
(B, T) forward vs a packed (num_tokens,) one), ``selective`` (the two forwards on a real model) and
``naive_packing`` (one causal SDPA over the whole packed row, and the block-diagonal causal mask
that repairs it); the pictures in ``minibatch.viz.selective``.
"""

from __future__ import annotations

from typing import Callable

import torch

from minibatch.experiments.naive_packing import (
    block_diagonal_causal_mask, causal_mask, row_forward,
)
from minibatch.experiments.selective import (
    packed_logits,
)
from minibatch.experiments.selective_cost import (
    LAYOUTS, ForwardCost, ModelDims, forward_cost,
)
from minibatch.lessons import exercise
from minibatch.runner.batch import PackedBatch
from minibatch.scheduler.base import SchedulerOutput
from minibatch.viz.selective import draw_attention_masks


def print_cost_table(lens: list[int], dims: ModelDims, layouts: tuple[str, ...] = LAYOUTS) -> list[ForwardCost]:
    """Print padded vs packed tokens and GFLOPs of one prefill of ``lens``; returns the rows."""
    rows = [forward_cost(lens, dims, layout) for layout in layouts]
    base = rows[layouts.index("packed")].total_flops if "packed" in layouts else rows[0].total_flops
    print(f"{'layout':<17}{'tokens':>7}{'padding':>8}{'attn pairs':>11}{'linear GFLOP':>13}"
          f"{'attn GFLOP':>11}{'total GFLOP':>12}{'x packed':>9}")
    for r in rows:
        print(f"{r.layout:<17}{r.num_computed_tokens:>7}{r.num_padding_tokens:>8}{r.num_attention_pairs:>11}"
              f"{r.linear_flops / 1e9:>13.2f}{r.attention_flops / 1e9:>11.3f}{r.total_flops / 1e9:>12.2f}"
              f"{r.total_flops / base:>9.2f}")
    return rows


@exercise.check(hint="True where query i and key j belong to the same request and j <= i, False elsewhere")
@torch.inference_mode()
def check_my_mask(mask_fn: Callable[[list[int]], torch.Tensor], runner,
                  cases: tuple[list[int], ...] = ([3], [2, 1, 3], [1, 1], [4, 2, 5, 1], [5, 8, 5])) -> str:
    """The exercise: for each ``seq_lens`` of ``cases``, one SDPA over a packed row of prompts of those lengths
    with ``mask_fn(seq_lens)`` (:func:`row_forward`) must give the logits of the runner's split attention
    (:func:`packed_logits`, atol 1e-3)."""
    for lens in cases:
        mask, n = exercise.require(mask_fn(list(lens)), "my_block_diagonal_causal_mask(seq_lens)"), sum(lens)
        got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        assert got == f"{(n, n)} {torch.bool}", f"for seq_lens {lens} the mask must be ({n}, {n}) torch.bool, got {got}"
        vocab = min(1000, runner.model.config.vocab_size - 10)
        prompts = [[10 + (7 * i + 3 * k) % vocab for k in range(length)] for i, length in enumerate(lens)]
        diff = float((row_forward(runner.model, prompts, mask) - packed_logits(runner, prompts)).abs().max())
        assert diff < 1e-3, f"for seq_lens {lens} one SDPA with your mask is {diff:.3g} off split attention's logits"
    return "on every case one SDPA with your mask reproduces the runner's split attention"


def print_packed_batch(out: SchedulerOutput, batch: PackedBatch) -> None:
    """Per request: phase, num_computed_tokens, num_new_tokens, seq_len, block_table, positions and
    slot_mapping of its new tokens; then the flat tensors of the step."""
    m = batch.attn_metadata
    print(f"{'request':<8}{'phase':<9}{'computed':>9}{'new':>5}{'seq_len':>8}  {'block_table':<13}"
          f"{'positions':<12}slot_mapping")
    for i, s in enumerate(out.scheduled):
        a, b = m.cu_seqlens_q[i], m.cu_seqlens_q[i + 1]
        pos = batch.positions[a:b].tolist()
        pos_s = f"{pos[0]}..{pos[-1]}" if len(pos) > 1 else str(pos[0])
        print(f"{s.request_id:<8}{s.phase:<9}{s.request.num_computed_tokens:>9}{s.num_new_tokens:>5}"
              f"{m.seq_lens[i]:>8}  {str(out.block_tables[s.request_id]):<13}{pos_s:<12}"
              f"{m.slot_mapping[a:b].tolist()}")
    print()
    print(f"input_ids      {tuple(batch.input_ids.shape)} {batch.input_ids.tolist()}")
    print(f"positions      {tuple(batch.positions.shape)} {batch.positions.tolist()}")
    print(f"slot_mapping   {tuple(m.slot_mapping.shape)} {m.slot_mapping.tolist()}")
    print(f"cu_seqlens_q   {m.cu_seqlens_q}")
    print(f"seq_lens       {m.seq_lens}")
    print(f"logits_indices {batch.logits_indices.tolist()}  (rows sampled: {batch.sample_request_ids})")


def draw_masks(seq_lens: list[int], names: list[str] | None = None):
    """Naive causal mask over the packed row (left) vs the block-diagonal causal mask (right), drawn
    by :func:`minibatch.viz.selective.draw_attention_masks`. Returns the Figure."""
    return draw_attention_masks({"naive: one causal mask over the whole packed row": causal_mask(sum(seq_lens)),
                                 "correct: block-diagonal causal mask": block_diagonal_causal_mask(seq_lens)},
                                seq_lens, names)
