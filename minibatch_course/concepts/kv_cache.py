"""Notebook 00b's picture: generating without and with a KV cache.

A 4-token prompt, then 4 steps of greedy generation. Without a cache (top) every step feeds the whole sequence
again, so the q, k, v of every earlier position are computed once more, and step s computes P + s positions. With a
KV cache (bottom) the first step (the prefill) computes the prompt's k and v once and keeps them; every later step
(a decode) computes q, k, v of the one new token only, appends its k and v to the cache and attends over all of
them. Hand-set numbers; nothing is run.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from minibatch.viz.plots import HATCH, PALETTE

NUM_PROMPT_TOKENS, NUM_STEPS = 4, 4
COLORS = {"prefill": PALETTE["prefill"], "decode": PALETTE["decode"], "recomputed": PALETTE["padding"],
          "cached": "#CFE3F1"}
HATCHES = {"recomputed": HATCH["padding"]}


def naive_cells() -> list[list[str]]:
    """Per step, the kind of each position: the newest position and everything before it, recomputed."""
    rows = [["prefill"] * NUM_PROMPT_TOKENS]
    for s in range(1, NUM_STEPS):
        rows.append(["recomputed"] * (NUM_PROMPT_TOKENS + s - 1) + ["decode"])
    return rows


def cached_cells() -> list[list[str]]:
    """Per step, the kind of each position: the prefill computes the prompt, each decode one new position."""
    rows = [["prefill"] * NUM_PROMPT_TOKENS]
    for s in range(1, NUM_STEPS):
        rows.append(["cached"] * (NUM_PROMPT_TOKENS + s - 1) + ["decode"])
    return rows


def _panel(ax, rows: list[list[str]], title: str, computed: list[int], names: list[str]):
    num_positions = NUM_PROMPT_TOKENS + NUM_STEPS - 1
    for s, row in enumerate(rows):
        for p, kind in enumerate(row):
            ax.add_patch(Rectangle((p + 0.05, s + 0.05), 0.9, 0.9, facecolor=COLORS[kind], edgecolor="white",
                                   hatch=HATCHES.get(kind), linewidth=0.5))
            label = "k v" if kind == "cached" else "q k v"
            ax.text(p + 0.5, s + 0.5, label, ha="center", va="center", fontsize=8,
                    color="white" if kind in ("prefill", "decode") else "black",
                    bbox=dict(facecolor="white", edgecolor="none", pad=1) if kind == "recomputed" else None)
        ax.text(-0.3, s + 0.5, names[s], ha="right", va="center", fontsize=9)
        ax.text(num_positions + 0.3, s + 0.5, f"computes {computed[s]} position{'s' * (computed[s] > 1)}",
                ha="left", va="center", fontsize=9)
    ax.text(num_positions + 0.3, len(rows) + 0.35, f"in all: {' + '.join(map(str, computed))} = {sum(computed)}",
            ha="left", va="center", fontsize=9, fontweight="bold")
    ax.set_xlim(-2.2, num_positions + 4.6)
    ax.set_ylim(len(rows) + 0.8, -0.1)
    ax.set_yticks([])
    ax.set_xticks([p + 0.5 for p in range(num_positions)], [str(p) for p in range(num_positions)], fontsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, loc="left", fontsize=10)


def draw() -> plt.Figure:
    """The figure: the naive loop (top) and the loop with a KV cache (bottom), one row per step."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.2), layout="constrained")
    naive = [NUM_PROMPT_TOKENS + s for s in range(NUM_STEPS)]
    cached = [NUM_PROMPT_TOKENS] + [1] * (NUM_STEPS - 1)
    _panel(top, naive_cells(), "without a cache: every step runs the whole sequence again, recomputing q, k, v "
           "of every earlier position", naive, [f"step {s}" for s in range(NUM_STEPS)])
    _panel(bottom, cached_cells(), "with a KV cache: each decode computes the new token's q, k, v, appends k, v "
           "to the cache and attends over all of them", cached,
           ["prefill"] + [f"decode {s}" for s in range(1, NUM_STEPS)])
    bottom.set_xlabel(f"token position ({NUM_PROMPT_TOKENS} prompt tokens, then one new token per step)", fontsize=9)
    handles = [Patch(facecolor=COLORS["prefill"], label="prefill: the prompt's positions, computed once"),
               Patch(facecolor=COLORS["decode"], label="the new token: computed"),
               Patch(facecolor=COLORS["recomputed"], hatch=HATCHES["recomputed"], edgecolor="white",
                     label="recomputed: the same q, k, v again"),
               Patch(facecolor=COLORS["cached"], label="read from the KV cache: k, v only")]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=9, frameon=False)
    return fig
