"""Draft, then verify: one step of speculative decoding and what it costs, for notebook 06.

A cheap draft model runs k = 4 forwards, one token each ("sat", "on", "a", "mat"); the target scores all k + 1
positions in ONE forward; the rejection sampler keeps the accepted prefix and adds one token of the target's own: a
correction at the first rejected position (top outcome: 2 accepted + "the" = 3 tokens), or a bonus token when all k
are accepted (second outcome: 4 + "and" = 5 tokens). The cost, in target-decode times: k draft forwards of c each plus
one verify forward of v, for 1 to k + 1 tokens, against one decode per token without speculation. Hand-set numbers
(c = 0.1, v = 1.2); no model, no engine.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from minibatch.viz.plots import PALETTE

K, C, V = 4, 0.1, 1.2  # drafts per step, a draft forward's and a verify forward's cost in target decodes
DRAFTS = ("sat", "on", "a", "mat")
COLORS = {"draft": "#999999", "verify": PALETTE["decode"], "accepted": "#009E73", "rejected": "#D55E00",
          "target": "#000000"}
HATCHES = {"draft": "///", "rejected": "//"}


def _box(ax, x, y, w, kind, text="", h=0.8, fontsize=9):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=COLORS[kind], edgecolor="white", hatch=HATCHES.get(kind),
                           linewidth=0.8))
    if text:
        color = "white" if kind in ("target", "rejected") else "black"
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=color,
                fontweight="bold" if kind == "target" else "normal",
                bbox=dict(facecolor=COLORS[kind], edgecolor="none", pad=3) if kind in ("draft", "rejected") else None)


def _step_panel(ax):
    """The step on a time axis: k draft forwards, one verify forward, then the two possible outcomes."""
    for i, tok in enumerate(DRAFTS):
        _box(ax, 0.2 + i * 1.1, 5.0, 1.0, "draft", f"{tok}")
    ax.text(0.2, 6.0, f"draft model: k = {K} cheap forwards,\none token each", fontsize=9, va="bottom")
    _box(ax, 4.8, 5.0, 5.5, "verify", f"target model: ONE forward over all k + 1 = {K + 1} positions")
    ax.text(4.8, 6.0, "verify: the target scores every draft\nand the position after them", fontsize=9, va="bottom")
    ax.annotate("", xy=(10.6, 4.7), xytext=(0.2, 4.7), arrowprops=dict(arrowstyle="-|>", color="black", lw=0.8))
    ax.text(10.7, 4.7, "time", fontsize=8, va="center")
    outcomes = [("draft wrong at position 3\n(later drafts are discarded):",
                 ["accepted", "accepted", "rejected", "rejected"], "the", "2 accepted + 1 correction = 3 tokens"),
                ("all k drafts right:", ["accepted"] * K, "and", f"{K} accepted + 1 bonus = {K + 1} tokens")]
    for row, (label, verdicts, own, total) in enumerate(outcomes):
        y = 2.9 - row * 1.6
        ax.text(4.7, y + 0.4, label, ha="right", va="center", fontsize=9)
        for i, (tok, kind) in enumerate(zip(DRAFTS, verdicts)):
            mark = {"accepted": "\u2713", "rejected": "\u2717"}[kind]
            _box(ax, 4.8 + i * 1.1, y, 1.0, kind, f"{tok} {mark}")
        first_bad = verdicts.index("rejected") if "rejected" in verdicts else K
        _box(ax, 4.8 + first_bad * 1.1, y - 0.55, 1.0, "target", own, h=0.5)
        ax.text(4.8 + first_bad * 1.1 - 0.1, y - 0.3, "the target's correction" if first_bad < K else
                "bonus token, from the target", fontsize=8, va="center", ha="right")
        ax.text(10.5, y + 0.4, total, fontsize=9, va="center")
    ax.set_xlim(-1.2, 14.6)
    ax.set_ylim(0.4, 6.8)
    ax.axis("off")
    ax.set_title(f"one step of speculative decoding, k = {K}", loc="left", fontsize=10)


def _cost_panel(ax):
    """Time in target-decode units: a speculative step against plain decodes for the same 3 tokens."""
    x = 0.0
    for _ in range(K):
        _box(ax, x, 1.2, C, "draft", h=0.6)
        x += C
    _box(ax, x, 1.2, V, "verify", "v", h=0.6)
    ax.text(x + V + 0.1, 1.5, f"speculative: k\u00b7c + v = {K}\u00d7{C} + {V} = {K * C + V:.1f} for 1 to "
            f"{K + 1} tokens (3 above)", fontsize=9, va="center")
    for i in range(3):
        _box(ax, i * 1.0, 0.2, 1.0, "verify", "decode", h=0.6, fontsize=8)
    ax.text(3.1, 0.5, "plain decoding: 1 forward per token, 3.0 for 3 tokens", fontsize=9, va="center")
    ax.text(0, 2.05, "expected speedup = E(\u03b1, k) / (k\u00b7c + v),   E(\u03b1, k) = (1 \u2212 \u03b1^(k+1)) / "
            "(1 \u2212 \u03b1) tokens per verify  (\u03b1: chance each draft is accepted)", fontsize=9)
    ax.set_xlim(0, 9.5)
    ax.set_ylim(0, 2.5)
    ax.set_xticks(range(0, 4), [str(t) for t in range(0, 4)], fontsize=8)
    ax.set_yticks([])
    ax.spines["bottom"].set_bounds(0, 3)
    ax.set_xlabel("time, in target decode forwards (c = a draft forward, v = a verify forward)", fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title("what it costs", loc="left", fontsize=10)


def draw():
    """The figure: the step and its two outcomes (top), its cost against plain decoding (bottom)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.2), layout="constrained",
                                      gridspec_kw={"height_ratios": [2.6, 1]})
    _step_panel(top)
    _cost_panel(bottom)
    labels = {"draft": "draft forward (cost c)", "verify": "target forward (verify: cost v; decode: 1)",
              "accepted": "draft token accepted", "rejected": "draft token rejected",
              "target": "the target's own token"}
    fig.legend(handles=[Patch(facecolor=COLORS[k], hatch=HATCHES.get(k), edgecolor="white", label=v)
                        for k, v in labels.items()], loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    return fig
