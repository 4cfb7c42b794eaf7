"""One step of selective batching, for notebook 03.

A step holds A's prefill (5 prompt tokens), B's decode (1 token; its 6 earlier tokens are in the KV cache) and
C's prefill (3 tokens). A padded (B, T) batch would compute 3 x 5 = 15 tokens, 6 of them padding. Selective
batching packs the 9 real tokens into one row of num_tokens: the linear layers (QKV projections, o projection,
MLP, LM head) run on that one row as one matrix multiply; only attention is split per request, each request's
queries against its own keys, and the outputs are merged back into the row. Hand-set numbers; no model, no engine.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from minibatch.viz.plots import HATCH, PALETTE
from minibatch.viz.selective import REQUEST_COLORS

# (name, phase, num_computed_tokens before the step, num_new_tokens)
STEP = (("A", "prefill", 0, 5), ("B", "decode", 6, 1), ("C", "prefill", 0, 3))


def _cell(ax, x, y, color, text="", hatch=None, alpha=1.0, text_color="white"):
    ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=color, edgecolor="white", hatch=hatch,
                           linewidth=0.5, alpha=alpha))
    if text:
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=8, color=text_color)


def _arrow(ax, xy0, xy1, color):
    ax.add_patch(FancyArrowPatch(xy0, xy1, arrowstyle="-|>", mutation_scale=10, color=color, linewidth=1.0))


def _padded(ax, x0: float, y0: float) -> None:
    """The same step as a padded (B, T) batch: one row per request, right-padded to the most new tokens."""
    width = max(n for *_, n in STEP)
    for i, (name, phase, done, n) in enumerate(STEP):
        y = y0 - i * 1.2
        for t in range(width):
            if t < n:
                _cell(ax, x0 + t, y, REQUEST_COLORS[i], str(done + t))
            else:
                _cell(ax, x0 + t, y, PALETTE["padding"], hatch=HATCH["padding"])
        ax.text(x0 - 0.2, y + 0.5, f"{name} ({phase})", ha="right", va="center", fontsize=9)
    num_padding = len(STEP) * width - sum(n for *_, n in STEP)
    ax.text(x0 - 3.2, y0 + 1.6, f"padded (B, T) = ({len(STEP)}, {width}):\n{len(STEP) * width} tokens computed, "
            f"{num_padding} of them padding", ha="left", va="center", fontsize=10)


def _row(ax, x0: float, y: float, label: str, note: str) -> list[float]:
    """The packed row of num_tokens: returns each request's centre x."""
    centres, x = [], x0
    for i, (name, _, done, n) in enumerate(STEP):
        for t in range(n):
            _cell(ax, x + t, y, REQUEST_COLORS[i], str(done + t))
        centres.append(x + n / 2)
        x += n
    ax.text(x0 - 0.2, y + 0.5, label, ha="right", va="center", fontsize=9)
    ax.text(x + 0.3, y + 0.5, note, ha="left", va="center", fontsize=9)
    return centres


def draw():
    """The figure: the padded batch (left) and the packed step through linear layers and split attention (right)."""
    fig, ax = plt.subplots(figsize=(12.5, 5.6), layout="constrained")
    _padded(ax, x0=3.5, y0=3.6)
    num_tokens = sum(n for *_, n in STEP)
    x_row = 17.0
    top = _row(ax, x_row, 7.0, f"packed row\n(num_tokens = {num_tokens}, hidden)",
               "QKV projections:\none matrix multiply")
    for i, (name, phase, _, n) in enumerate(STEP):  # who is who, above the packed row
        ax.text(top[i], 8.3, f"{name}: {phase}", ha="center", va="center", fontsize=9, color=REQUEST_COLORS[i],
                fontweight="bold")
    bottom = _row(ax, x_row, 0.0, "merged row\n(num_tokens, hidden)",
                  "o projection, MLP, LM head:\none matrix multiply")
    x = 12.0  # the split: each request's queries against its keys (cached keys pale)
    for i, (name, _, done, n) in enumerate(STEP):
        for p in range(done + n):
            cached = p < done
            _cell(ax, x + p, 3.5, REQUEST_COLORS[i], str(p), alpha=0.35 if cached else 1.0,
                  text_color="black" if cached else "white")
        centre = x + (done + n) / 2
        ax.text(centre, 3.2, f"{name}: {n} quer{'y' if n == 1 else 'ies'} x {done + n} keys"
                + (f"\n({done} from the KV cache)" if done else ""), ha="center", va="top", fontsize=8)
        _arrow(ax, (top[i], 6.95), (centre, 4.6), REQUEST_COLORS[i])
        _arrow(ax, (centre, 2.2), (bottom[i], 1.05), REQUEST_COLORS[i])
        x += done + n + 1.5
    ax.text(11.8, 4.0, "attention,\nsplit per request", ha="right", va="center", fontsize=9)
    ax.text(11.8, 1.5, "merge back\nin place", ha="right", va="center", fontsize=9)
    ax.axvline(10.0, color="#888888", linewidth=0.8, linestyle=":")
    ax.set_xlim(0, 33)
    ax.set_ylim(-0.5, 9.2)
    ax.axis("off")
    handles = [Patch(facecolor=c, label=f"request {name}") for c, (name, *_) in zip(REQUEST_COLORS, STEP)]
    handles += [Patch(facecolor=REQUEST_COLORS[1], alpha=0.35, label="key already in the KV cache"),
                Patch(facecolor=PALETTE["padding"], hatch=HATCH["padding"], edgecolor="white", label="padding")]
    fig.legend(handles=handles, loc="outside lower center", ncols=5, fontsize=9, frameon=False)
    ax.set_title(f"one step, {len(STEP)} requests: padded versus packed (numbers in cells: token positions)",
                 loc="left", fontsize=10)
    return fig
