"""Notebook 05's picture: a whole long prefill stalls every decode; stall-free batching does not.

Three chats are decoding when a 512-token prompt arrives. Top: the prompt's whole prefill runs in one step, and
no chat gets a token until it ends (a generation stall, one long ITL). Bottom: stall-free batching under a token
budget of 64: every step takes the running decodes first (one token each), then a chunk of the prompt with the
budget that is left, so each chat gets a token every short step; the prompt's first token comes later. Right:
the tokens in one step of each kind against the budget. Step times come from a hand-set cost model (30 ms per
step + 1.5 ms per token computed); nothing is run.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from minibatch.viz.plots import HATCH, PALETTE

STEP_MS, TOKEN_MS = 30.0, 1.5  # the hand-set cost model
NUM_DECODES, PROMPT_LEN, BUDGET = 3, 512, 64
DECODES_BEFORE, DECODES_AFTER = 3, 3  # plain decode steps before the prompt arrives and after its first token
ROWS = [f"chat {i + 1}" for i in range(NUM_DECODES)] + [f"{PROMPT_LEN}-token prompt"]


def step_ms(num_tokens: int) -> float:
    """A step's time under the hand-set cost model, ms."""
    return STEP_MS + TOKEN_MS * num_tokens


def schedule(chunked: bool) -> list[tuple[int, int]]:
    """The steps as (decode tokens, prompt tokens): a whole prefill alone (prefill-first), or chunks under BUDGET."""
    steps = [(NUM_DECODES, 0)] * DECODES_BEFORE
    if not chunked:
        steps.append((0, PROMPT_LEN))
    else:
        left = PROMPT_LEN
        while left:
            chunk = min(left, BUDGET - NUM_DECODES)
            steps.append((NUM_DECODES, chunk))
            left -= chunk
    return steps + [(NUM_DECODES + 1, 0)] * DECODES_AFTER


def _timeline(ax, steps, title):
    """Rows = the chats and the long prompt, x = time (ms); returns the longest gap between a chat's tokens."""
    t, last, worst, gap = 0.0, 0.0, 0.0, (0.0, 0.0)
    prompt_left = PROMPT_LEN
    for decodes, prompt in steps:
        dt = step_ms(decodes + prompt)
        if decodes:
            for row in range(NUM_DECODES):
                ax.barh(row, dt, left=t, height=0.8, color=PALETTE["decode"], edgecolor="white", linewidth=0.6)
            if t + dt - last > worst:
                worst, gap = t + dt - last, (last, t)
            last = t + dt
        if prompt:
            prompt_left -= prompt
            kind = "chunk" if prompt_left else "prefill"
            ax.barh(NUM_DECODES, dt, left=t, height=0.8, color=PALETTE[kind], hatch=HATCH.get(kind),
                    edgecolor="white", linewidth=0.6)
            ax.text(t + dt / 2, NUM_DECODES, str(prompt), ha="center", va="center", fontsize=8)
        elif decodes > NUM_DECODES:
            ax.barh(NUM_DECODES, dt, left=t, height=0.8, color=PALETTE["decode"], edgecolor="white", linewidth=0.6)
        t += dt
    if gap[1] - gap[0] > 4 * step_ms(NUM_DECODES):  # a stall: say so in the empty rows
        ax.text(sum(gap) / 2, (NUM_DECODES - 1) / 2, "generation stall:\nno chat gets a token", ha="center",
                va="center", fontsize=8)
    ax.set_yticks(range(len(ROWS)), ROWS, fontsize=8)
    ax.set_ylim(len(ROWS) - 0.4, -0.6)
    ax.set_title(f"{title}: longest gap between a chat's tokens (ITL) {worst:.0f} ms", loc="left", fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=8)
    return worst


def _step_bars(ax):
    """One step of each kind as stacked token bars: decodes at the bottom, then the prompt's tokens."""
    whole, chunk = (0, PROMPT_LEN), (NUM_DECODES, BUDGET - NUM_DECODES)
    for x, (decodes, prompt), kind in ((0, whole, "prefill"), (1.2, chunk, "chunk")):
        ax.bar(x, decodes, color=PALETTE["decode"], width=0.6)
        ax.bar(x, prompt, bottom=decodes, color=PALETTE[kind], hatch=HATCH.get(kind), edgecolor="white", width=0.6)
        ax.text(x, decodes + prompt + 60, f"{decodes} decodes\n+ {prompt} prompt", ha="center", fontsize=8)
    ax.axhline(BUDGET, color="black", ls="--", lw=1)
    ax.text(1.75, BUDGET + 6, f"token budget {BUDGET}", ha="right", va="bottom", fontsize=8)
    ax.set_xticks([0, 1.2], ["whole\nprefill step", "stall-free\nstep"], fontsize=8)
    ax.set_xlim(-0.45, 1.8)
    ax.set_ylim(0, PROMPT_LEN * 1.3)  # headroom over the tallest bar and its label
    ax.set_ylabel("tokens in the step", fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title("one step's tokens", loc="left", fontsize=9)


def draw() -> plt.Figure:
    fig = plt.figure(figsize=(11, 4.6), layout="constrained")
    grid = fig.add_gridspec(2, 2, width_ratios=[3.8, 1.2])
    top = fig.add_subplot(grid[0, 0])
    bottom = fig.add_subplot(grid[1, 0], sharex=top)
    _timeline(top, schedule(chunked=False), "whole prefill in one step (prefill-first)")
    _timeline(bottom, schedule(chunked=True), f"stall-free batching, token budget {BUDGET}")
    bottom.set_xlabel(f"time (ms; hand-set cost: {STEP_MS:.0f} ms per step + {TOKEN_MS} ms per token)", fontsize=8)
    _step_bars(fig.add_subplot(grid[:, 1]))
    handles = [Patch(facecolor=PALETTE["decode"], label="decode (one token per chat)"),
               Patch(facecolor=PALETTE["chunk"], hatch=HATCH["chunk"], edgecolor="white",
                     label="prefill chunk (no token yet)"),
               Patch(facecolor=PALETTE["prefill"], label="prefill reaching the prompt's end")]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    return fig
