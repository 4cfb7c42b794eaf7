"""Simulator figures (notebook 07): throughput against latency per setup over a rate sweep, the
calibrated cost model against its measured steps, and the simulator's error against measured runs.
Each returns its Axes; times are seconds, drawn in ms where labelled."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from minibatch.viz.results import POLICY_COLORS


def plot_rate_sweep(rows: list[dict], y: str = "e2e_p99_s", ax=None, title: str | None = None):
    """Output throughput (x) against ``y`` (a latency), one line per setup, a point per rate."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    styles = {"static bs=8": ":", "static bs=32": "--", "static bs=64": "-.", "orca (max)": "--"}
    for name in dict.fromkeys(r["setup"] for r in rows):
        pts = sorted((r for r in rows if r["setup"] == name), key=lambda r: r["rate"])
        color = POLICY_COLORS.get(name.split()[0], None)
        ax.plot([p["output_throughput_tok_s"] for p in pts], [p[y] for p in pts], marker="o", ms=3,
                ls=styles.get(name, "-"), color=color, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel(y.replace("_s", " (s)").replace("_", " "))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def plot_calibration(samples: dict[str, tuple[list[dict], np.ndarray]], packed, axes=None):
    """Left: measured vs predicted step time of every calibration step (``samples``: layout ->
    (sample rows with "time_s", predicted times in s), "packed" and "padded"; the band is +-15%).
    Right: packed steps' time against num_tokens, with the fitted curve(N) of ``packed`` (a
    LayoutModel: ``knots``, ``curve_s``)."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    ax, ax2 = axes
    for layout, marker in (("packed", "o"), ("padded", "s")):
        rows, pred = samples.get(layout, ([], None))
        if rows:
            ax.scatter([r["time_s"] * 1e3 for r in rows], pred * 1e3, s=8, marker=marker, alpha=0.5, label=layout)
    lim = np.array(ax.get_xlim())
    ax.plot(lim, lim, color="black", lw=0.8)
    ax.fill_between(lim, lim * 0.85, lim * 1.15, color="grey", alpha=0.15, label="+-15%")
    ax.set(xscale="log", yscale="log", xlabel="measured step time (ms)", ylabel="predicted (ms)",
           title="every calibration step, measured vs the fit")
    ax.legend(fontsize=8)
    rows, _ = samples.get("packed", ([], None))
    kinds = {"decode": "decode batches", "long": "long context", "prefill": "one prefill", "chunked": "chunked trace"}
    for kind, label in kinds.items():
        pts = [r for r in rows if r["scenario"].startswith(kind)]
        ax2.scatter([r["num_tokens"] for r in pts], [r["time_s"] * 1e3 for r in pts], s=8, alpha=0.5, label=label)
    ax2.plot(packed.knots, np.array(packed.curve_s) * 1e3, color="black", lw=1, marker="|", label="fitted curve(N)")
    ax2.set(xscale="log", yscale="log", xlabel="tokens in the step (N)", ylabel="step time (ms)",
            title="packed steps: cost against tokens")
    ax2.legend(fontsize=8)
    return axes


def plot_validation(report: dict, ax=None):
    """Simulation error of output throughput and TTFT p50, per trace and policy (bars); the
    dashed lines are the acceptance bound (15%), the dotted ones the goal (10%)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 3.5), layout="constrained")
    labels, thr, ttft = [], [], []
    for name, t in report["traces"].items():
        for r in t["policies"]:
            labels.append(f"{r['policy']}\n{name.split('-seed')[0]}")
            thr.append(r["error"]["output_throughput_tok_s"] * 100)
            ttft.append(r["error"]["ttft_p50_s"] * 100)
    x = np.arange(len(labels))
    ax.bar(x - 0.2, thr, 0.4, label="output throughput", color="#0072B2")
    ax.bar(x + 0.2, ttft, 0.4, label="TTFT p50", color="#E69F00")
    for y, ls in ((15, "--"), (10, ":")):
        ax.axhline(y, color="grey", ls=ls, lw=0.8)
        ax.axhline(-y, color="grey", ls=ls, lw=0.8)
    ax.set_xticks(x, labels, fontsize=6, rotation=90)
    ax.set_ylabel("simulated vs measured (%)")
    ax.legend(fontsize=8)
    return ax
