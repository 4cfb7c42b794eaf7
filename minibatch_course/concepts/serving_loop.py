"""Notebook 08's picture: a request's round trip through a server, and where the client measures TTFT and ITL.

Top: clients send JSON requests over HTTP to an OpenAI-compatible API; the handler submits each request to the
async engine loop, which repeats three things: admit the requests that arrived (only between steps), run one
step (schedule, forward, sample), and stream each request's new token back as a Server-Sent Event (SSE). The
client reads the events as they arrive. Bottom: one request seen from the client: TTFT runs from sending the
request to its first event, ITL is the gap between two events; both include the network, HTTP and queueing that
the engine's own clock leaves out. The event times are hand-set; nothing is run.
"""

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from minibatch.viz.plots import PALETTE

CLIENT, SERVER, ENGINE = "#CC79A7", "#009E73", "#999999"  # reddish purple, bluish green, grey (boxes, labelled)
SEND_MS = 0
EVENTS_MS = [190, 250, 310, 420, 480, 540]  # one request's SSE arrivals; the 4th step also ran a newcomer's prefill


def _box(ax, x, y, w, h, color, text, fontsize=8, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.4,rounding_size=1.2", facecolor=color,
                                alpha=0.22, edgecolor=color, linewidth=1.5))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, weight=weight)


def _arrow(ax, start, end, text="", offset=(0, 1.6), style="-|>", rad=0.0, ls="-"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color="black", linewidth=1.1,
                                 connectionstyle=f"arc3,rad={rad}", linestyle=ls))
    if text:
        ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], text, ha="center",
                va="bottom", fontsize=8)


def _architecture(ax):
    """Clients -> HTTP API -> the engine loop (admit, step, stream) -> SSE back to the clients."""
    ax.set_xlim(0, 104)
    ax.set_ylim(0, 44)
    ax.axis("off")
    for i, name in enumerate(("client A", "client B", "client C")):
        _box(ax, 2, 30 - 9 * i, 14, 5, CLIENT, name)
    ax.text(9, 39.5, "clients", ha="center", fontsize=9, weight="bold")
    ax.text(9, 6.5, "client-side clock:\nstamps at send and\nat each event's arrival\n-> TTFT, ITL", ha="center",
            va="center", fontsize=8)
    _box(ax, 29, 10, 18, 24, SERVER, "HTTP server\n\nOpenAI-compatible API\nPOST /v1/completions\n"
         "POST /v1/chat/\ncompletions")
    _arrow(ax, (17, 27), (28.5, 27), "request (JSON)")
    _arrow(ax, (28.5, 16), (17, 16), "SSE stream:\none event per\nnew token", offset=(0, -8.5))
    ax.text(74, 41, "async engine loop (one step at a time)", ha="center", fontsize=9, weight="bold")
    _box(ax, 58, 30, 32, 6.5, ENGINE, "1  admit new requests\n(only between steps)")
    _box(ax, 58, 18.5, 32, 6.5, ENGINE, "2  one step: schedule -> forward -> sample\n(every running request)")
    _box(ax, 58, 7, 32, 6.5, ENGINE, "3  stream each new token\nas a Server-Sent Event")
    _arrow(ax, (74, 29.3), (74, 26))
    _arrow(ax, (74, 17.8), (74, 14.5))
    _arrow(ax, (91, 10), (91, 33), rad=0.6)
    ax.text(100, 21.5, "next\nstep", ha="center", va="center", fontsize=8)
    _arrow(ax, (47.5, 30), (57.3, 33), "submit")
    _arrow(ax, (57.3, 10), (47.5, 14), "tokens", offset=(0, -5))


def _timeline(ax):
    """One request on the client's clock: send, then one tick per SSE event; TTFT and ITL as brackets."""
    ax.axhline(0, color="black", lw=0.8)
    ax.plot([SEND_MS], [0], marker="o", color="black", ms=6)
    ax.text(SEND_MS, -0.35, "send", ha="center", va="top", fontsize=8)
    for i, t in enumerate(EVENTS_MS):
        color = PALETTE["prefill"] if i == 0 else PALETTE["decode"]
        ax.plot([t, t], [-0.18, 0.18], color=color, lw=3, solid_capstyle="butt")
        ax.text(t, -0.35, f"token {i + 1}", ha="center", va="top", fontsize=8)
    _bracket(ax, SEND_MS, EVENTS_MS[0], 0.45, "TTFT = first event - send\n(queueing + prefill step + HTTP)")
    _bracket(ax, EVENTS_MS[1], EVENTS_MS[2], 0.45, "ITL")
    _bracket(ax, EVENTS_MS[2], EVENTS_MS[3], 0.45, "longer ITL: a newcomer's\nprefill shared this step")
    _bracket(ax, EVENTS_MS[4], EVENTS_MS[5], 0.45, "ITL")
    ax.set_xlim(-30, EVENTS_MS[-1] + 40)
    ax.set_ylim(-0.9, 1.35)
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("time on the client (ms, hand-set)", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title("one request, as the client sees it", loc="left", fontsize=9)
    handles = [Line2D([], [], color=PALETTE["prefill"], lw=3, label="first token (from the prefill step)"),
               Line2D([], [], color=PALETTE["decode"], lw=3, label="later tokens (decode steps)")]
    ax.legend(handles=handles, loc="upper right", fontsize=8, frameon=False)


def _bracket(ax, x0, x1, y, text):
    ax.annotate("", xy=(x0, y), xytext=(x1, y), arrowprops=dict(arrowstyle="<->", color="black", lw=1))
    ax.text((x0 + x1) / 2, y + 0.08, text, ha="center", va="bottom", fontsize=8)


def draw() -> plt.Figure:
    fig = plt.figure(figsize=(11, 6.2), layout="constrained")
    grid = fig.add_gridspec(2, 1, height_ratios=[3.1, 1.5])
    _architecture(fig.add_subplot(grid[0]))
    _timeline(fig.add_subplot(grid[1]))
    return fig
