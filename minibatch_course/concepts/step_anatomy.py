"""Notebook 07b's picture: what one decode step is made of, and where it sits under the roofline.

Top: one decode step as a timeline. Each decoder layer runs the same sequence of small operations (norm, the QKV
projections, rotary embeddings, writing the new K/V into the paged cache, attention over the cached context, the
output projection, norm, MLP); the model repeats it once per layer, then the LM head turns the last hidden states
into logits and the sampler picks the tokens. Between operations the Python interpreter walks the modules: grey
gaps, the same length whatever the batch. Bottom: the roofline. A step can be no faster than reading every weight
once (the flat memory roof) nor than computing every token at peak arithmetic (the rising compute roof); a
measured step sits above the larger of the two. Widths and times are hand-set; nothing is run.
"""

import matplotlib.pyplot as plt
import numpy as np

GAP = "#D9D9D9"  # Python between operations
# one layer's operations in order: (name, width in arbitrary time units, colour)
LAYER = [("norm", 0.5, "#56B4E9"), ("QKV", 1.4, "#0072B2"), ("rotary", 0.6, "#56B4E9"), ("KV write", 0.4, "#E69F00"),
         ("attention", 2.6, "#D55E00"), ("O", 0.8, "#0072B2"), ("norm", 0.5, "#56B4E9"),
         ("MLP", 3.0, "#009E73")]
TAIL = [("LM head", 1.6, "#CC79A7"), ("sample", 0.6, "#F0E442")]


def _timeline(ax):
    x = 0.0
    for layer in range(2):
        start = x
        for name, width, color in LAYER:
            ax.barh(0, width, left=x, color=color, edgecolor="white", height=0.6)
            if layer == 0:
                ax.text(x + width / 2, 0.42, name, ha="center", va="bottom", fontsize=7, rotation=35)
            x += width
            ax.barh(0, 0.25, left=x, color=GAP, height=0.6)  # the interpreter between two operations
            x += 0.25
        ax.annotate("", xy=(x, -0.45), xytext=(start, -0.45), arrowprops=dict(arrowstyle="<->", lw=0.8))
        ax.text((start + x) / 2, -0.62, f"layer {layer}", ha="center", va="top", fontsize=8)
    ax.text(x + 0.8, 0, "...  x every\ndecoder layer", ha="left", va="center", fontsize=8)
    x += 5.5
    for name, width, color in TAIL:
        ax.barh(0, width, left=x, color=color, edgecolor="white", height=0.6)
        ax.text(x + width / 2, 0.42, name, ha="center", va="bottom", fontsize=7, rotation=35)
        x += width + 0.25
    ax.barh(-1.3, 0.6, left=0, color=GAP, height=0.35)
    ax.text(0.8, -1.3, "Python between operations (the same whatever the batch)", va="center", fontsize=8)
    ax.set_xlim(-0.5, x + 0.5)
    ax.set_ylim(-1.7, 1.6)
    ax.axis("off")
    ax.set_title("One decode step: the same small operations in every layer, then the LM head and sampling",
                 fontsize=10)


def _roofline(ax):
    tokens = np.linspace(1, 64, 200)
    memory, compute = np.full_like(tokens, 8.0), tokens * 0.7
    ax.plot(tokens, memory, color="#0072B2", lw=1.5, label="memory roof: read every weight once")
    ax.plot(tokens, compute, color="#009E73", lw=1.5, label="compute roof: 2 FLOPs per weight per token")
    ax.fill_between(tokens, np.maximum(memory, compute), 0, color="#EBEBEB", zorder=0)
    ax.text(50, 14, "no step can be this fast", fontsize=8, ha="center")
    for t, measured in ((1, 35.0), (32, 95.0)):
        bound = max(8.0, t * 0.7)
        ax.plot([t, t], [bound, measured], color="black", lw=0.8, ls=":")
        ax.plot(t, measured, "o", color="black")
        ax.text(t + 1.2, measured, f"a measured step:\n{'memory' if bound == 8.0 else 'compute'}-bound, far "
                "above its roof", fontsize=7.5, va="center")
    ax.set_xlabel("tokens computed in the step (decode batch size)")
    ax.set_ylabel("step time")
    ax.set_xlim(0, 66)
    ax.set_ylim(0, 110)
    ax.set_yticks([])
    ax.legend(fontsize=8, loc="upper left", frameon=False, bbox_to_anchor=(0.0, 0.98))
    ax.set_title("The roofline: a step sits above max(bytes / bandwidth, FLOPs / peak)", fontsize=10)


def draw():
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.6), height_ratios=[1, 1.4], layout="constrained")
    _timeline(top)
    _roofline(bottom)
    return fig
