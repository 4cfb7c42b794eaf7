"""Figures for notebook 03 (selective batching): the same prompts padded and packed, the split and merge
around attention in one packed step, and attention masks over a packed row."""

from __future__ import annotations

from itertools import accumulate

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from minibatch.viz.plots import HATCH, PALETTE

# Okabe-Ito colors for requests A, B, C, ...: blue, bluish green, reddish purple, black, then sky blue and yellow.
# No orange: vermillion (hatched) marks padding and leaks, and orange next to it would read as the same colour.
REQUEST_COLORS = ("#0072B2", "#009E73", "#CC79A7", "#000000", "#56B4E9", "#F0E442")
LEAK_HATCH = "xxx"  # a score across requests: vermillion, cross-hatched


def _color(i: int) -> str:
    return REQUEST_COLORS[i % len(REQUEST_COLORS)]


def _cell(ax, x, y, color, text="", hatch=None, w=1.0, h=1.0, fontsize=8, text_color="white", alpha=1.0):
    ax.add_patch(Rectangle((x + 0.04, y + 0.04), w - 0.08, h - 0.08, facecolor=color, edgecolor="white",
                           hatch=hatch, linewidth=0.5, alpha=alpha))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def _finish(ax, x1: float, y1: float, x0: float = 0.0, y0: float = 0.0, aspect="equal") -> None:
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_aspect(aspect)
    ax.axis("off")


def draw_padded_vs_packed(lens: list[int], names: list[str] | None = None):
    """The same prompts padded and packed, one cell per token, colored by request.

    Top: the padded (B, T) batch, one row per request, padding hatched. Bottom: the packed
    (num_tokens,) row, wrapped every T tokens so that the two areas compare directly. A cell is a tall
    rectangle (a quarter inch high), so a long prompt stays readable. Returns the Figure.
    """
    names = names or [f"req-{i}" for i in range(len(lens))]
    T, N, B = max(lens), sum(lens), len(lens)
    packed_rows = -(-N // T)
    y_pad = packed_rows + 2.5  # the padded block sits above the packed one, with room for a caption
    height = y_pad + B + 2.0
    fig, ax = plt.subplots(figsize=(11, 0.27 * height + 0.3), layout="constrained")
    for i, n in enumerate(lens):
        y = y_pad + B - 1 - i
        for t in range(T):
            real = t < n
            _cell(ax, t, y, _color(i) if real else PALETTE["padding"], hatch=None if real else HATCH["padding"])
        ax.text(-0.6, y + 0.5, f"{names[i]} ({n})", ha="right", va="center", fontsize=8)
    ax.text(0, y_pad + B + 0.4, f"padded (B, T) = ({B}, {T}): {B * T} tokens computed, "
            f"{B * T - N} of them padding (hatched)", fontsize=10, va="bottom")
    request = torch.repeat_interleave(torch.arange(B), torch.tensor(lens)).tolist()  # (N,) request of each token
    for k, i in enumerate(request):  # token k of the packed row, wrapped every T cells
        _cell(ax, k % T, packed_rows - 1 - k // T, _color(i))
    ax.text(0, packed_rows + 0.4, f"packed (num_tokens,) = ({N},): every token real, requests back to back "
            f"(wrapped every {T} tokens)", fontsize=10, va="bottom")
    _finish(ax, T, height, x0=-T / 8, aspect="auto")
    return fig


def _arrow(ax, xy0, xy1, color="#555555"):
    ax.add_patch(FancyArrowPatch(xy0, xy1, arrowstyle="-|>", mutation_scale=10, color=color, linewidth=1.0,
                                 shrinkA=2, shrinkB=2))


def draw_split_merge(out, batch):
    """Selective batching around one attention layer, for the packed step ``out`` (a SchedulerOutput)
    and ``batch`` (its PackedBatch, ``minibatch.runner.batch.build_packed_batch``).

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


def draw_attention_masks(masks: dict[str, torch.Tensor], seq_lens: list[int], names: list[str] | None = None):
    """(N, N) bool attention masks over one packed row of requests of lengths ``seq_lens`` (N =
    sum(seq_lens), True = the query row may attend to the key column), side by side, titled by the
    keys of ``masks``.

    Cells a query may attend to are colored by the query's request when the key is its own
    request's, vermillion and cross-hatched when it is another request's (a leak); masked cells stay light
    grey. A legend under the panels names the three. Returns the Figure.
    """
    names = names or [f"req-{i}" for i in range(len(seq_lens))]
    n = sum(seq_lens)
    request = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens)).tolist()
    fig, axes = plt.subplots(1, len(masks), figsize=(5.5 * len(masks), 5.6), layout="constrained", squeeze=False)
    for ax, (title, mask) in zip(axes[0], masks.items()):
        for q in range(n):
            for k in range(n):
                leak = bool(mask[q, k]) and request[q] != request[k]
                color = PALETTE["padding"] if leak else _color(request[q]) if mask[q, k] else PALETTE["idle"]
                ax.add_patch(Rectangle((k, n - 1 - q), 1, 1, facecolor=color, edgecolor="white", linewidth=0.3,
                                       hatch=LEAK_HATCH if leak else None))
        num_leaks = int((mask & (torch.tensor(request)[:, None] != torch.tensor(request)[None, :])).sum())
        ax.set_title(f"{title}\n{int(mask.sum())} scores kept, {num_leaks} across requests (hatched)",
                     loc="left", fontsize=9)
        starts = [0, *accumulate(seq_lens)]  # cu_seqlens_q
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
    fig.legend(handles=[Patch(facecolor=_color(0), label="kept: a key of the query's own request (one colour per "
                              "request)"),
                        Patch(facecolor=PALETTE["padding"], hatch=LEAK_HATCH, edgecolor="white",
                              label="kept: a key of another request (a leak)"),
                        Patch(facecolor=PALETTE["idle"], label="masked out")],
               loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    return fig
