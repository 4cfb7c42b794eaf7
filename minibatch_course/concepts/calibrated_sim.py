"""A calibrated simulator in four steps (notebook 07): measure real steps of the model on the wall clock, fit a
cost model (a profile: step time from the tokens in the step and their context), run the very same schedulers on
a simulated clock that charges each step what the fit predicts (thousands of requests in seconds, no model), and
check the simulation against measured runs on traces the fit never saw.

Black is the wall clock (measured), reddish purple the simulated clock (the fit); every number is hand-set.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Patch

from minibatch.viz.plots import PALETTE

MEASURED, SIMULATED = "#000000", "#CC79A7"  # wall clock, simulated clock
TOKENS = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
CURVE_MS = np.array([57, 89, 94, 106, 126, 164, 239, 396, 709, 1351])  # a CPU's step time by tokens in the step
NOISE = np.array([1.05, 0.93, 1.08, 0.97, 1.1, 0.95, 1.04, 0.92, 1.06, 0.98])
# a simulated schedule: (kind, tokens) per step, priced by the curve
STEPS = [("prefill", 96), ("decode", 1), ("decode", 2), ("prefill", 64), ("decode", 3), ("decode", 3), ("decode", 2)]
# held-out traces: measured and simulated output throughput (tokens/s)
HELD_OUT = {"rate 4": (52, 51), "rate 8": (47, 47), "long prompts": (30, 31)}


def _measure(ax) -> None:
    """Panel 1: real steps of the model, timed on the wall clock."""
    for reps, shift in ((3, 0.0), (2, 0.06)):
        for k in range(reps):
            ax.scatter(TOKENS * (1 + shift * k), CURVE_MS * NOISE ** (k + 1), s=14, color=MEASURED,
                       label="a measured step" if (reps, k) == (3, 0) else None)
    ax.text(0.04, 0.96, "the real engine and model\ndecode batches, prefills,\nchunked traces, static batches",
            transform=ax.transAxes, va="top", fontsize=8)


def _fit(ax) -> None:
    """Panel 2: the profile, a curve of step time against tokens (plus context terms)."""
    ax.scatter(TOKENS, CURVE_MS * NOISE, s=14, color=MEASURED, alpha=0.35, label="measured steps")
    ax.plot(TOKENS, CURVE_MS, color=SIMULATED, lw=2.2, marker="|", ms=8, label="fitted curve(N)")
    ax.text(0.04, 0.96, "step time = curve(N)\n  + c·context + …\n(least squares)", transform=ax.transAxes,
            va="top", fontsize=8, family="monospace")


def _simulate(ax) -> None:
    """Panel 3: the same scheduler, each step charged its predicted time on a simulated clock."""
    t = 0.0
    for i, (kind, n) in enumerate(STEPS):
        width = np.interp(np.log(n), np.log(TOKENS), CURVE_MS) / 1e3
        ax.barh(0, width, left=t, height=0.5, color=PALETTE[kind], edgecolor="white", hatch="//" * (kind == "prefill"))
        ax.text(t + width / 2, 0, str(n), ha="center", va="center", fontsize=8)
        t += width
    ax.set_xlim(0, t * 1.02)
    ax.set_ylim(-0.6, 1.6)
    ax.set_yticks([])
    ax.set_xlabel("simulated time (s)", fontsize=9)
    ax.text(0.02, 0.95, "same scheduler objects;\nSimExecutor: no model;\nSimClock charges each step\n"
            "the fit's time (label: tokens)", transform=ax.transAxes, va="top", fontsize=8)
    ax.legend(handles=[Patch(facecolor=PALETTE["prefill"], hatch="//", edgecolor="white", label="prefill step"),
                       Patch(facecolor=PALETTE["decode"], label="decode step")], fontsize=8, loc="lower right")


def _validate(ax) -> None:
    """Panel 4: measured against simulated on held-out traces, with a tolerance band."""
    x = np.arange(len(HELD_OUT))
    measured, simulated = zip(*HELD_OUT.values())
    m = np.array(measured)
    ax.bar(x, 0.3 * m, 0.95, bottom=0.85 * m, color="#DDDDDD", label="measured ± 15%", zorder=0)
    ax.bar(x - 0.2, measured, 0.4, color=MEASURED, label="measured (wall clock)")
    ax.bar(x + 0.2, simulated, 0.4, color=SIMULATED, hatch="..", edgecolor="white", label="simulated")
    ax.set_xticks(x, list(HELD_OUT), fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_ylabel("output tokens/s", fontsize=9)


def draw():
    """The four steps side by side, joined by arrows; returns the Figure."""
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.8), width_ratios=[1, 1, 1.25, 1])
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.17, top=0.82, wspace=0.5)
    titles = ["1 · measure real steps\n(wall clock)", "2 · fit a cost model\n(the profile)",
              "3 · run the schedulers on a\nsimulated clock: 1000s of requests",
              "4 · validate on traces\nthe fit never saw"]
    for ax, title, panel in zip(axes, titles, (_measure, _fit, _simulate, _validate)):
        panel(ax)
        ax.set_title(title, fontsize=10)
        ax.tick_params(labelsize=8)
    for ax in axes[:2]:
        ax.set(xscale="log", yscale="log", ylim=(40, 4000))
        ax.set_xlabel("tokens in the step (N)", fontsize=9)
        ax.set_ylabel("step time (ms)", fontsize=9)
        ax.legend(fontsize=8, loc="lower right")
    axes[3].legend(fontsize=8, loc="upper center")
    for left, right in zip(axes[:-1], axes[1:]):
        x0, x1 = left.get_position().x1, right.get_position().x0
        fig.patches.append(FancyArrowPatch((x0 + 0.006, 0.5), (x1 - 0.045, 0.5), transform=fig.transFigure,
                                           arrowstyle="-|>", mutation_scale=16, color="dimgrey", lw=1.5))
    return fig
