"""The course on one page: a request's life from arrival to its last streamed token, and the notebook that changes
each stage.

A request arrives and waits in the queue; the scheduler admits it; a prefill step computes its whole prompt (writing
K/V into the KV cache) and samples the first token; decode steps add one token each, the scheduler choosing the batch
again before every step; tokens stream to the client; and TTFT, ITL and throughput measure it all. Each badge names
the notebook (01-09) that changes that stage and how.
"""

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from minibatch.viz.plots import PALETTE

GREEN, BLUE, PURPLE, GREY = "#009E73", "#0072B2", "#CC79A7", "#EBEBEB"

# (x0, x1, fill, text colour, label): the stages in time order, left to right, in axes units (0-100)
STAGES = [
    (1, 12, PALETTE["waiting"], "black", "arrive,\nwait in\nthe queue"),
    (15, 34, GREEN, "white", "scheduler admits\n(which requests run,\nhow many tokens each)"),
    (37, 56, PALETTE["prefill"], "black", "prefill\nwhole prompt → KV cache,\nfirst token sampled"),
    (59, 78, PALETTE["decode"], "black", "decode steps\none new token per\nrequest per step"),
    (81, 99, PURPLE, "black", "stream tokens\nto the client\n(last token: done)"),
]
STAGE_Y, STAGE_H, KV_Y, KV_H = 45, 11, 32.5, 8

# (x0, x1, y, notebook, what it changes): one badge per notebook, under the stage it changes
BADGES = [
    (15, 34, 25.5, "01", "static batching: admit a\nbatch, run it to its end\n(request-level)"),
    (15, 34, 15.5, "02", "iteration-level (Orca):\nadmit at every step"),
    (37, 56, 25.5, "05", "chunked prefill (Sarathi-\nServe): token budget,\nstall-free steps"),
    (59, 78, 25.5, "06", "speculative decoding:\ndraft k tokens, verify\nthem in one step"),
    (37, 78, 15.5, "03", "selective batching: prefill and decode tokens\npacked in one forward"),
    (81, 99, 25.5, "08", "serving lab: an\nOpenAI-compatible\nserver; TTFT, ITL\nat the client"),
]


def _box(ax, x0, x1, y, h, fill, edge="none"):
    ax.add_patch(FancyBboxPatch((x0, y), x1 - x0, h, boxstyle="round,pad=0,rounding_size=1.2", facecolor=fill,
                                edgecolor=edge, linewidth=1.0))


def _arrow(ax, start, end, style="-|>", rad=0.0, color="black", dashed=False):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color, linewidth=1.3,
                                 connectionstyle=f"arc3,rad={rad}", linestyle="--" if dashed else "-"))


def _badge(ax, x0, x1, y, number, text):
    """A white card under a stage: the notebook number in bold on the left, what it changes beside it."""
    lines = text.count("\n") + 1
    h = 2.6 * lines + 1.6
    _box(ax, x0, x1, y - h / 2, h, "white", edge="black")
    ax.text(x0 + 1.0, y, number, ha="left", va="center", fontsize=11, fontweight="bold")
    ax.text(x0 + 4.2, y, text, ha="left", va="center", fontsize=8.5, linespacing=1.15)


def draw() -> Figure:
    """The course map: five stages of a request's life, the KV cache and the measurements under them, and the
    notebook that changes each."""
    fig = Figure(figsize=(10, 5.9))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set(xlim=(0, 100), ylim=(0, 65))
    ax.axis("off")
    ax.text(50, 64, "A request's life, from arrival to its last streamed token, and the notebook that changes each"
            " stage", ha="center", va="top", fontsize=11, fontweight="bold")
    mid = STAGE_Y + STAGE_H / 2
    for x0, x1, fill, color, label in STAGES:
        _box(ax, x0, x1, STAGE_Y, STAGE_H, fill)
        ax.text((x0 + x1) / 2, mid, label, ha="center", va="center", fontsize=9, color=color, linespacing=1.2)
    for (_, a, *_), (b, *_) in zip(STAGES, STAGES[1:]):
        _arrow(ax, (a + 0.2, mid), (b - 0.2, mid))
    # the step loop: after every decode step the scheduler chooses the next batch
    _arrow(ax, (68.5, STAGE_Y + STAGE_H + 0.3), (24.5, STAGE_Y + STAGE_H + 0.3), rad=0.12)
    ax.text(46.5, 60.3, "every step: schedule → one forward → sample → update", ha="center", va="center",
            fontsize=8.5, style="italic")
    # the KV cache under prefill and decode: prefill writes the prompt's K/V, decode reads it and adds one token's
    _box(ax, 37, 78, KV_Y, KV_H, BLUE)
    ax.text(38.5, KV_Y + KV_H / 2, "KV\ncache", ha="left", va="center", fontsize=9.5, color="white",
            fontweight="bold")
    _badge(ax, 45, 77, KV_Y + KV_H / 2, "04", "paged KV cache (vLLM): blocks,\npreemption, prefix caching")
    for x, label in ((46.5, "writes K/V"), (68.5, "reads, appends")):
        _arrow(ax, (x, STAGE_Y - 0.3), (x, KV_Y + KV_H + 0.3), color=BLUE)
        ax.text(x + 1, (STAGE_Y + KV_Y + KV_H) / 2, label, ha="left", va="center", fontsize=8, color=BLUE)
    for x0, x1, y, number, text in BADGES:
        _badge(ax, x0, x1, y, number, text)
    # measurement spans the whole life: arrival time, first token, every token gap, the finish
    _box(ax, 1, 99, 0.8, 9.2, GREY, edge="black")
    ax.text(2.5, 8.0, "measured all along: TTFT = first token − arrival; ITL = gap between tokens; throughput",
            ha="left", va="center", fontsize=9, fontweight="bold")
    _badge(ax, 2.5, 49, 4.0, "07", "benchmarks: a calibrated simulator, rate sweeps")
    _badge(ax, 51, 97.5, 4.0, "09", "wrap-up: the papers' claims vs ours, goodput under SLOs")
    return fig
