"""Notebook 08b's picture: many replicas behind a router, and prefill and decode on separate replicas.

Left: a router sends each request to one of several replicas, each a whole engine with its own KV cache. Turns of
one conversation (same colour) share a prefix: a router that sends them to the same replica finds their earlier
turns in its prefix cache ("hit"); one that scatters them computes them again. Right: disaggregated serving: a
prefill replica computes the prompt and the first token, the request's KV blocks travel over a link, and a decode
replica generates the rest, its steps never holding a prefill. Positions are hand-set; nothing is run.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

CONVERSATIONS = {"A": "#0072B2", "B": "#E69F00", "C": "#009E73"}  # one colour per conversation
REPLICA, LINK = "#999999", "#CC79A7"


def _box(ax, x, y, w, h, color, text, alpha=0.22, fontsize=8):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.3,rounding_size=1", facecolor=color,
                                alpha=alpha, edgecolor=color, linewidth=1.3))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end, color="black", text="", style="-|>"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=11, color=color, linewidth=1.1))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 1.2, text, ha="center", va="bottom", fontsize=8)


def _routers(ax):
    ax.set_xlim(0, 60)
    ax.set_ylim(0, 44)
    ax.axis("off")
    ax.text(30, 42, "a router in front of replicas", ha="center", fontsize=9, weight="bold")
    for i, (name, color) in enumerate(CONVERSATIONS.items()):
        for t in range(2):
            ax.add_patch(plt.Rectangle((1 + 4.2 * t, 30 - 9 * i), 3.6, 4, color=color))
            ax.text(2.8 + 4.2 * t, 32 - 9 * i, f"{name}{t + 1}", ha="center", va="center", fontsize=7, color="white")
    ax.text(5, 38, "turns of\nconversations", ha="center", fontsize=8)
    _box(ax, 14, 14, 10, 14, "#56B4E9", "router")
    for i in range(3):
        _arrow(ax, (9.5, 32 - 9 * i), (13.5, 21))
    labels = ("replica 1\nprefix cache: A", "replica 2\nprefix cache: B", "replica 3\nprefix cache: C")
    for i, text in enumerate(labels):
        _box(ax, 36, 30 - 12 * i, 16, 8, REPLICA, text)
        _arrow(ax, (24.5, 21), (35.5, 34 - 12 * i), color=list(CONVERSATIONS.values())[i])
    ax.text(30, 1, "prefix affinity: every turn of A goes where A's earlier turns are cached (a hit);\n"
            "round robin scatters them and computes those turns again", ha="center", fontsize=8)


def _disaggregated(ax):
    ax.set_xlim(0, 60)
    ax.set_ylim(0, 44)
    ax.axis("off")
    ax.text(30, 42, "prefill and decode on separate replicas", ha="center", fontsize=9, weight="bold")
    _box(ax, 2, 16, 14, 12, "#D55E00", "prefill replica\nprompt + first\ntoken")
    for i in range(3):
        _box(ax, 40, 30 - 12 * i, 16, 8, "#56B4E9", f"decode replica {i + 1}\nonly decode steps")
    _arrow(ax, (16.5, 22), (39.5, 34), color=LINK)
    _arrow(ax, (16.5, 22), (39.5, 22), color=LINK, text="KV blocks over a link")
    _arrow(ax, (16.5, 22), (39.5, 10), color=LINK)
    ax.text(30, 1, "a decode step never waits behind a prefill (steadier time between tokens),\n"
            "but every prompt queues for the prefill side and its KV must travel", ha="center", fontsize=8)


def draw():
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    _routers(left)
    _disaggregated(right)
    return fig
