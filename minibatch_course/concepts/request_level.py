"""Request-level (static) batching and its three wastes, for notebook 01.

A static batch of 4 requests with output lengths 4, 12, 6 and 16 runs as one padded (B, T) tensor: the prefill
step left-pads the prompts to the longest one (padding), every row keeps computing until the longest request is
done (early-finish waste: rows of finished requests compute padding tokens), and req-4, arriving at step 2 while
the batch runs, waits for the whole batch before it can start (queueing). Hand-set numbers; no model, no engine.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from minibatch_course.concepts import cell_legend
from minibatch.viz.plots import HATCH, PALETTE

PROMPT_LENS = (5, 8, 3, 6)  # prompt tokens of req-0..req-3
OUTPUT_LENS = (4, 12, 6, 16)  # output tokens of req-0..req-3
LATE = (2, 6)  # req-4: arrives at step 2, asks for 6 tokens


def _cell(ax, x, y, kind):
    ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=PALETTE[kind], edgecolor="white",
                           hatch=HATCH.get(kind), linewidth=0.5))


def _prefill_panel(ax):
    """Step 0 as a (B, T) tensor: each prompt left-padded to the longest."""
    width = max(PROMPT_LENS)
    for i, n in enumerate(PROMPT_LENS):
        for t in range(width):
            _cell(ax, t, i, "padding" if t < width - n else "prefill")
        ax.text(-0.3, i + 0.5, f"req-{i}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-2.2, width + 0.2)
    ax.set_ylim(len(PROMPT_LENS) + 1.6, -1.4)
    ax.set_title("step 0, the prefill: one (B, T) tensor", loc="left", fontsize=10)
    ax.text(0, len(PROMPT_LENS) + 0.2, "padding: short prompts are\nleft-padded to the longest",
            ha="left", va="top", fontsize=9, color=PALETTE["padding"])
    ax.text(width / 2, -0.3, f"T = {width} prompt positions", ha="center", va="bottom", fontsize=8)
    ax.axis("off")


def _timeline_panel(ax):
    """One row per request, one column per step: the batch runs until its longest member is done."""
    batch_end = max(OUTPUT_LENS)  # steps 0 .. batch_end - 1: prefill (token 1), then one decode per token
    for i, n in enumerate(OUTPUT_LENS):
        for s in range(batch_end):
            _cell(ax, s, i, "prefill" if s == 0 else "decode" if s < n else "padding")
        ax.text(-0.3, i + 0.5, f"req-{i}", ha="right", va="center", fontsize=9)
    arrival, late_len = LATE
    y = len(OUTPUT_LENS) + 0.6
    for s in range(arrival, batch_end + late_len):
        _cell(ax, s, y, "waiting" if s < batch_end else "prefill" if s == batch_end else "decode")
    ax.text(-0.3, y + 0.5, "req-4", ha="right", va="center", fontsize=9)
    ax.axvline(batch_end, color="black", linewidth=1, linestyle="--")
    ax.text(batch_end + 0.15, -0.25, "the batch ends when\nits longest request ends", ha="left", va="bottom",
            fontsize=8)
    ax.annotate("early-finish waste: req-0 is done after 4 steps,\nbut its row computes padding until step 15",
                xy=(9, 0.5), xytext=(8.5, -1.2), ha="center", va="bottom", fontsize=9,
                arrowprops=dict(arrowstyle="-|>", color="black", linewidth=0.8))
    ax.annotate("queueing: req-4 arrives at step 2\nand waits for the whole batch", xy=(9, y + 1.0),
                xytext=(9, y + 1.7), ha="center", va="top", fontsize=9,
                arrowprops=dict(arrowstyle="-|>", color="black", linewidth=0.8))
    ax.set_xlim(-2.2, batch_end + late_len + 0.2)
    ax.set_ylim(y + 3.4, -2.4)
    ax.set_xticks([s + 0.5 for s in range(0, batch_end + late_len, 3)],
                  [str(s) for s in range(0, batch_end + late_len, 3)], fontsize=8)
    ax.set_yticks([])
    ax.set_xlabel("step", fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title("the batch, step by step: rows keep running until the longest request finishes",
                 loc="left", fontsize=10)


def draw():
    """The figure: the padded prefill (left) and the batch's steps with req-4 queueing (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained",
                                      gridspec_kw={"width_ratios": [1, 3]})
    _prefill_panel(left)
    _timeline_panel(right)
    cell_legend(fig, {"prefill": "prefill", "decode": "decode (one token)", "padding": "padding (computed, no token)",
                      "waiting": "waiting"})
    return fig
