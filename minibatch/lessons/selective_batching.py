"""Helpers for notebook 03 (selective batching): cost counts, forwards, naive packing, pictures.

Orca (Yu et al., OSDI'22) §3.2, *selective batching*: the linear layers (QKV and output
projections, MLP, LM head) and the norms treat every token alike, so the tokens of all requests
in a step run *packed* as one (num_tokens, hidden) matrix, with no padding. Attention is the one
operation where a token must see only its own request's keys, so around attention the packed
tokens are *split* per request, attend against that request's KV cache, and are *merged* back.
Our implementation is ``minibatch/runner/batch.py`` (the packed tensors and ``cu_seqlens_q`` /
``seq_lens`` / ``slot_mapping``) and ``minibatch/runner/attention.py`` (the split and merge).

This module adds what a notebook cell should not hold:

* token and FLOP counts of a padded (B, T) forward versus a packed (num_tokens,) one;
* the two forwards on a real model (padded with HF's SDPA and a mask, packed with our runner);
* *naive* packing: one causal SDPA over the whole packed row, as if it were one sequence (what
  goes wrong without the split), and the block-diagonal causal mask that repairs it;
* the pictures: padded vs packed, split / merge around attention, the two masks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from matplotlib.patches import FancyArrowPatch, Rectangle

from minibatch.models import attention_implementation, pad_token_id
from minibatch.request import Request, SamplingParams
from minibatch.runner import attention
from minibatch.runner.batch import PackedBatch, build_packed_batch
from minibatch.scheduler.base import ScheduledRequest, SchedulerOutput
from minibatch.viz.plots import HATCH, PALETTE

# Okabe-Ito colors for requests A, B, C, ... (vermillion is kept for padding and for leaks)
REQUEST_COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
ROW_ATTENTION = "minibatch_row_sdpa"
LAYOUTS = ("padded", "packed", "packed, row mask")


# ----------------------------------------------------------------------------- counting

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


# ----------------------------------------------------------------------------- the two forwards

def prefill_output(prompts: list[list[int]], block_size: int = 16) -> SchedulerOutput:
    """A hand-built SchedulerOutput: every prompt as a whole prefill ("req-0", "req-1", ...), each
    with its own contiguous run of KV blocks (block ids 0, 1, ... in order). Allocate at least
    ``num_blocks_used(out)`` blocks of ``block_size`` before running it."""
    scheduled, block_tables, next_block = [], {}, 0
    for i, ids in enumerate(prompts):
        r = Request(f"req-{i}", list(ids), max_new_tokens=1, sampling=SamplingParams(ignore_eos=True))
        n = -(-len(ids) // block_size)  # blocks for the prompt, rounded up
        block_tables[r.request_id] = list(range(next_block, next_block + n))
        next_block += n
        scheduled.append(ScheduledRequest(r, len(ids), "prefill", row=i))
    return SchedulerOutput(scheduled=scheduled, block_tables=block_tables)


def num_blocks_used(out: SchedulerOutput) -> int:
    """Smallest KV cache (in blocks) that holds every block id of ``out.block_tables``."""
    return 1 + max(b for bt in out.block_tables.values() for b in bt)


@torch.inference_mode()
def packed_forward(runner, out: SchedulerOutput) -> torch.Tensor:
    """One packed (1, num_tokens) forward of ``out`` with selective batching: the runner's own
    ``build_packed_batch`` and split/merge attention (``runner.kv_cache`` must be allocated).

    Unlike ``ModelRunner.execute`` it returns logits for *every* token, (num_tokens, vocab_size),
    in packed order, so they can be compared token by token.
    """
    if runner.kv_cache is None:
        raise RuntimeError("call runner.allocate_kv_cache(num_blocks, block_size) first")
    batch = build_packed_batch(out, runner.kv_cache)
    with attention_implementation(runner.model, attention.ATTN_IMPLEMENTATION):
        return runner.model(input_ids=batch.input_ids[None], position_ids=batch.positions[None],  # (1, num_tokens)
                            attn_metadata=batch.attn_metadata, logits_to_keep=0, use_cache=False).logits[0]


def packed_logits(runner, prompts: list[list[int]], block_size: int = 16) -> torch.Tensor:
    """:func:`packed_forward` of ``prompts`` as one prefill step (see :func:`prefill_output`), with
    a KV cache just big enough allocated first. Returns (num_tokens, vocab_size) logits."""
    out = prefill_output(prompts, block_size)
    runner.allocate_kv_cache(num_blocks_used(out), block_size)
    return packed_forward(runner, out)


@torch.inference_mode()
def padded_forward(model, prompts: list[list[int]]) -> torch.Tensor:
    """One padded (B, T) forward, T = the longest prompt, with HF's SDPA attention and a mask.

    Prompts are right-padded here (position p of row i is token p of prompt i, so real tokens
    are ``logits[i, :len(prompt_i)]``); the static engine left-pads instead, so that every row's
    last token lines up for decoding. The padding count is the same.
    Returns logits (B, T, vocab_size), padding rows included.
    """
    max_len = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), max_len), pad_token_id(model), dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(prompts), max_len), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    with attention_implementation(model, "sdpa"):
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (B, T, vocab_size)


def unpad(padded_logits: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The real tokens' rows of a right-padded (B, T, V) tensor, in packed order: (sum(lens), V)."""
    return torch.cat([padded_logits[i, :n] for i, n in enumerate(lens)])


def time_forwards(fns: dict[str, Callable[[], torch.Tensor]], repeats: int = 3) -> dict[str, tuple[float, torch.Tensor]]:
    """Best-of-``repeats`` wall time (s) of each ``fn()``, and its result from the last call.

    The functions run in interleaved rounds (a, b, a, b, ...), so that a burst of load from other
    processes on a shared CPU slows both rather than just one of them.
    """
    best = {name: float("inf") for name in fns}
    results = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            results[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: (best[name], results[name]) for name in fns}


# ----------------------------------------------------------------------------- naive packing

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


def check_mask(mask_fn: Callable[[list[int]], torch.Tensor],
               cases: tuple[list[int], ...] = ([3], [2, 1, 3], [1, 1], [4, 2, 5, 1])) -> list[list[int]]:
    """The exercise's check: ``mask_fn(seq_lens)`` against :func:`block_diagonal_causal_mask`.

    Returns the seq_lens for which the answer differs (wrong shape, dtype or value); [] = correct.
    """
    wrong = []
    for lens in cases:
        mask = mask_fn(list(lens))
        expected = block_diagonal_causal_mask(list(lens))
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and torch.equal(mask, expected)):
            wrong.append(list(lens))
    return wrong


# ----------------------------------------------------------------------------- the packed batch, printed

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


@torch.inference_mode()
def next_token_alone(model, requests: list[Request]) -> dict[str, int]:
    """Greedy next token of each request run alone (HF SDPA, one unpadded forward of all its
    tokens, no cache): the reference a batched step must reproduce."""
    with attention_implementation(model, "sdpa"):
        return {r.request_id: int(model(input_ids=torch.tensor([r.all_token_ids]), use_cache=False,
                                        logits_to_keep=1).logits[0, -1].argmax()) for r in requests}


# ----------------------------------------------------------------------------- pictures

def _color(i: int) -> str:
    return REQUEST_COLORS[i % len(REQUEST_COLORS)]


def _cell(ax, x, y, color, text="", hatch=None, w=1.0, h=1.0, fontsize=8, text_color="white", alpha=1.0):
    ax.add_patch(Rectangle((x + 0.04, y + 0.04), w - 0.08, h - 0.08, facecolor=color, edgecolor="white",
                           hatch=hatch, linewidth=0.5, alpha=alpha))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def _finish(ax, x1: float, y1: float, x0: float = 0.0, y0: float = 0.0) -> None:
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_aspect("equal")
    ax.axis("off")


def draw_padded_vs_packed(lens: list[int], names: list[str] | None = None):
    """The same prompts padded and packed, one cell per token, colored by request.

    Top: the padded (B, T) batch, one row per request, padding hatched. Bottom: the packed
    (num_tokens,) row, wrapped every T tokens so that the two areas compare directly.
    Returns the Figure.
    """
    names = names or [f"req-{i}" for i in range(len(lens))]
    T, N, B = max(lens), sum(lens), len(lens)
    packed_rows = -(-N // T)
    y_pad = packed_rows + 2.5  # the padded block sits above the packed one, with room for a caption
    height = y_pad + B + 2.0
    fig, ax = plt.subplots(figsize=(11, 11 * height / (T + 14) + 0.3), layout="constrained")
    for i, n in enumerate(lens):
        y = y_pad + B - 1 - i
        for t in range(T):
            real = t < n
            _cell(ax, t, y, _color(i) if real else PALETTE["padding"], hatch=None if real else HATCH["padding"])
        ax.text(-0.6, y + 0.5, f"{names[i]} ({n})", ha="right", va="center", fontsize=8)
    ax.text(0, y_pad + B + 0.4, f"padded (B, T) = ({B}, {T}): {B * T} tokens computed, "
            f"{num_padding_tokens(lens)} of them padding (hatched)", fontsize=10, va="bottom")
    request = torch.repeat_interleave(torch.arange(B), torch.tensor(lens)).tolist()  # (N,) request of each token
    for k, i in enumerate(request):  # token k of the packed row, wrapped every T cells
        _cell(ax, k % T, packed_rows - 1 - k // T, _color(i))
    ax.text(0, packed_rows + 0.4, f"packed (num_tokens,) = ({N},): every token real, requests back to back "
            f"(wrapped every {T} tokens)", fontsize=10, va="bottom")
    _finish(ax, T, height, x0=-14)
    return fig


def _arrow(ax, xy0, xy1, color="#555555"):
    ax.add_patch(FancyArrowPatch(xy0, xy1, arrowstyle="-|>", mutation_scale=10, color=color, linewidth=1.0,
                                 shrinkA=2, shrinkB=2))


def draw_split_merge(out: SchedulerOutput, batch: PackedBatch):
    """Selective batching around one attention layer, for the packed step ``out`` / ``batch``.

    Top: the packed row (one cell per new token, colored by request, labelled with its position)
    going through the linear layers as one matrix; middle: the split, one attention per request,
    its queries (new tokens) against its keys (the whole context: cached + new); bottom: the
    merge back into the packed row for the o projection and the MLP. Returns the Figure.
    """
    m = batch.attn_metadata
    n = len(batch.input_ids)
    gap = 1.5  # space between requests in the split row
    widths = [max(m.seq_lens[i], 3) for i in range(len(out.scheduled))]
    split_w = sum(widths) + gap * (len(widths) - 1)
    x_pack = (split_w - n) / 2  # the packed rows, centered over the split
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * split_w + 3), 5.2), layout="constrained")
    y_top, y_split, y_bot = 7.0, 3.2, 0.0

    def packed_row(y, label):
        for i, s in enumerate(out.scheduled):
            for t in range(m.cu_seqlens_q[i], m.cu_seqlens_q[i + 1]):
                _cell(ax, x_pack + t, y, _color(i), str(int(batch.positions[t])))
        ax.text(x_pack - 0.3, y + 0.5, label, ha="right", va="center", fontsize=8)

    packed_row(y_top, "packed row\n(num_tokens, hidden)")
    for i, s in enumerate(out.scheduled):  # request names between the cu_seqlens_q ticks
        ax.text(x_pack + (m.cu_seqlens_q[i] + m.cu_seqlens_q[i + 1]) / 2, y_top + 1.2, s.request_id,
                ha="center", va="center", fontsize=9, color=_color(i), fontweight="bold")
    for c in m.cu_seqlens_q:  # request boundaries: cu_seqlens_q
        ax.plot([x_pack + c] * 2, [y_top + 1.05, y_top + 1.35], color="black", linewidth=1)
        ax.text(x_pack + c, y_top + 1.45, str(c), ha="center", va="bottom", fontsize=8)
    ax.text(x_pack + n + 0.3, y_top + 1.45, "cu_seqlens_q", ha="left", va="bottom", fontsize=8)
    ax.text(x_pack + n + 0.3, y_top + 0.5, "q, k, v projections:\none matmul for all tokens", ha="left",
            va="center", fontsize=8)
    packed_row(y_bot, "merged output\n(num_tokens, hidden)")
    ax.text(x_pack + n + 0.3, y_bot + 0.5, "o projection, MLP, LM head:\none matmul for all tokens",
            ha="left", va="center", fontsize=8)

    x = 0.0
    for i, s in enumerate(out.scheduled):
        q0, q1, seq_len = m.cu_seqlens_q[i], m.cu_seqlens_q[i + 1], m.seq_lens[i]
        num_cached = seq_len - (q1 - q0)
        for p in range(seq_len):  # keys: cached context (pale) then this step's new tokens
            cached = p < num_cached
            _cell(ax, x + p, y_split, _color(i), str(p), text_color="black" if cached else "white", fontsize=7,
                  alpha=0.35 if cached else 1.0)
        ax.text(x + widths[i] / 2, y_split - 0.35, f"{s.request_id}: {q1 - q0} quer{'y' if q1 - q0 == 1 else 'ies'}"
                f" x {seq_len} keys\n({num_cached} cached + {q1 - q0} new)", ha="center", va="top", fontsize=8)
        mid_split = x + seq_len / 2
        _arrow(ax, (x_pack + (q0 + q1) / 2, y_top - 0.05), (mid_split, y_split + 1.05), _color(i))
        _arrow(ax, (mid_split, y_split - 1.15), (x_pack + (q0 + q1) / 2, y_bot + 1.05), _color(i))
        x += widths[i] + gap
    ax.text(x - gap + 0.3, y_split + 0.5, "keys by position; pale: K/V read\nfrom the KV cache (block_table),\n"
            "the new tokens' K/V are first\nwritten there (slot_mapping)", ha="left", va="center", fontsize=8)
    ax.text(-0.3, y_split + 0.5, "split:\nattention\nper request", ha="right", va="center", fontsize=8)
    ax.text(-0.3, (y_split + y_bot) / 2 - 0.3, "merge", ha="right", va="center", fontsize=8)
    _finish(ax, max(split_w, x_pack + n) + 0.2, y_top + 2.2, x0=min(0.0, x_pack) - 5.5, y0=-0.3)
    ax.set_title("selective batching: packed linear layers, attention split per request and merged",
                 loc="left", fontsize=10)
    return fig


def draw_masks(seq_lens: list[int], names: list[str] | None = None):
    """Naive causal mask over the packed row (left) vs the block-diagonal causal mask (right).

    Cells a query may attend to are colored by the query's request when the key is its own
    request's, vermillion when it is another request's (a leak); masked cells stay light grey.
    Returns the Figure.
    """
    names = names or [f"req-{i}" for i in range(len(seq_lens))]
    n = sum(seq_lens)
    request = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens)).tolist()
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.6), layout="constrained")
    masks = {"naive: one causal mask over the whole packed row": causal_mask(n),
             "correct: block-diagonal causal mask": block_diagonal_causal_mask(seq_lens)}
    for ax, (title, mask) in zip(axes, masks.items()):
        for q in range(n):
            for k in range(n):
                if not mask[q, k]:
                    color = PALETTE["idle"]
                elif request[q] == request[k]:
                    color = _color(request[q])
                else:
                    color = PALETTE["padding"]
                ax.add_patch(Rectangle((k, n - 1 - q), 1, 1, facecolor=color, edgecolor="white", linewidth=0.3))
        num_leaks = int((mask & (torch.tensor(request)[:, None] != torch.tensor(request)[None, :])).sum())
        ax.set_title(f"{title}\n{int(mask.sum())} scores kept, {num_leaks} across requests (vermillion)",
                     loc="left", fontsize=9)
        starts = [0, *(end + 1 for end in last_token_rows(seq_lens))]  # cu_seqlens_q
        centers = [(a + b) / 2 for a, b in zip(starts, starts[1:])]
        ax.set_xticks(centers, names, fontsize=8)
        ax.set_yticks([n - c for c in centers], names, fontsize=8)  # query 0 on top
        for b in starts[1:-1]:  # request boundaries
            ax.axvline(b, color="black", linewidth=0.6)
            ax.axhline(n - b, color="black", linewidth=0.6)
        ax.set_xlim(0, n)
        ax.set_ylim(0, n)
        ax.set_aspect("equal")
        ax.set_xlabel("key (packed index)")
        ax.set_ylabel("query (packed index)")
        ax.tick_params(length=0)
    return fig
