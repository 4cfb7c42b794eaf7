"""Notebook 09's picture: why a paper's speedup is not a constant, and why goodput is not throughput.

Left: the same scheduling idea (continuous batching fills the rows a static batch leaves idle, here 8 busy rows
become 32) on two step-cost curves. Where a decode step is memory-bound (a GPU) it costs about the same at 8 and
32 requests, so 4x the rows is nearly 4x the tokens per second; where it grows with the batch (this course's CPU)
the same 4x rows buy far less. Right: as the offered request rate grows, throughput keeps up until the server
saturates, but goodput (requests per second that meet a TTFT and a TPOT SLO) peaks earlier and then falls: a
server is sized by the highest rate at which most requests still meet their SLOs. All numbers are hand-set.
"""

import matplotlib.pyplot as plt
import numpy as np

MEMORY_BOUND = (20.0, 0.2)  # ms per step, ms per request: a decode step that hardly grows with the batch
COMPUTE_BOUND = (50.0, 8.0)  # a step whose time grows with every request in it
STATIC_ROWS, CONTINUOUS_ROWS = 8, 32
CAPACITY = 1.0  # requests/s the hand-set server completes at most
GOOD_RATE, GOOD_WIDTH = 0.8, 0.06  # where the fraction of requests meeting the SLOs falls, and how fast


def step_ms(rows: int, cost: tuple[float, float]) -> float:
    """A decode step of ``rows`` requests under a hand-set (fixed ms, ms per request) cost."""
    return cost[0] + cost[1] * rows


def _cost_panel(ax):
    rows = np.arange(1, 65)
    for cost, name, color, ls in ((MEMORY_BOUND, "memory-bound decode (GPU-like)", "#0072B2", "-"),
                                  (COMPUTE_BOUND, "cost grows with the batch (CPU-like)", "#D55E00", "--")):
        ax.plot(rows, [step_ms(r, cost) for r in rows], color=color, ls=ls, lw=2)
        t8, t32 = step_ms(STATIC_ROWS, cost), step_ms(CONTINUOUS_ROWS, cost)
        ax.plot([STATIC_ROWS, CONTINUOUS_ROWS], [t8, t32], "o", color=color)
        gain = (CONTINUOUS_ROWS / t32) / (STATIC_ROWS / t8)
        ax.annotate(f"{name}:\n{CONTINUOUS_ROWS // STATIC_ROWS}x the rows, {t32 / t8:.1f}x the step time\n"
                    f"-> {gain:.1f}x the tokens per second", xy=(CONTINUOUS_ROWS, t32),
                    xytext=(36, t32 + (-110 if cost is COMPUTE_BOUND else 60)), fontsize=8, color="black",
                    arrowprops=dict(arrowstyle="-", color=color, lw=1))
    for x, text in ((STATIC_ROWS, "static batch:\n8 busy rows"), (CONTINUOUS_ROWS, "continuous:\n32 rows")):
        ax.axvline(x, color="grey", lw=0.8, ls=":")
        ax.text(x + 0.8, 520, text, fontsize=8, va="top")
    ax.set(xlim=(0, 64), ylim=(0, 540), xlabel="requests in a decode step", ylabel="step time (ms, hand-set)")
    ax.set_title("one idea, two cost curves, two speedups", loc="left", fontsize=9)


def _goodput_panel(ax):
    rate = np.linspace(0.02, 1.6, 200)
    throughput = CAPACITY * np.tanh(rate / CAPACITY)  # keeps up, then saturates
    good = 1 / (1 + np.exp((rate - GOOD_RATE) / GOOD_WIDTH))  # fraction of requests meeting both SLOs
    goodput = throughput * good
    ax.plot(rate, throughput, color="black", ls="--", lw=2)
    ax.plot(rate, goodput, color="#009E73", lw=2.5)
    ax.text(1.25, 0.66, "throughput\n(every finished request)", fontsize=8, ha="center")
    ax.text(0.22, 0.5, "goodput: requests/s\nmeeting the TTFT and\nTPOT SLOs", fontsize=8, ha="center")
    sustained = rate[np.nonzero(good >= 0.9)[0][-1]]
    ax.axvline(sustained, color="grey", lw=0.8, ls=":")
    ax.text(sustained - 0.03, 0.98, "highest rate with\n>= 90% of requests\nmeeting the SLOs", fontsize=8, ha="right",
            va="top")
    ax.fill_between(rate, 0, 1.1, where=good < 0.5, color="#999999", alpha=0.15, lw=0)
    ax.text(1.55, 1.03, "most requests miss the SLOs", fontsize=8, ha="right", va="top")
    ax.set(xlim=(0, 1.6), ylim=(0, 1.1), xlabel="offered rate (requests/s, hand-set)", ylabel="requests/s")
    ax.set_title("goodput is not throughput", loc="left", fontsize=9)


def draw() -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    _cost_panel(left)
    _goodput_panel(right)
    for ax in (left, right):
        ax.tick_params(labelsize=8)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    return fig
