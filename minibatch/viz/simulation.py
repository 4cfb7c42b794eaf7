"""Simulator figures (notebook 07): throughput against latency per setup over a rate sweep, normalized latency
against rate with the capacity bound, the calibrated cost model against its measured steps, and the simulator's
error against measured runs. Each returns its Axes; times are seconds, drawn in ms where labelled."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from minibatch.viz.results import POLICY_COLORS

# A setup's line: its policy's colour, and a line style and marker of its own (setups of one policy differ)
LINE_STYLES = {"static bs=8": ":", "static bs=32": "--", "static bs=64": "-.", "orca (max)": "--"}
MARKERS = {"static bs=8": "v", "static bs=32": "s", "static bs=64": "D", "orca": "o", "paged": "^", "chunked": "x",
           "orca (max)": "P"}


def _line_style(name: str) -> dict:
    """Plot keywords of setup ``name`` ("static bs=8", "orca", ...): colour, line style, marker."""
    return dict(color=POLICY_COLORS.get(name.split()[0]), ls=LINE_STYLES.get(name, "-"),
                marker=MARKERS.get(name, "o"))


def _by_setup(rows: list[dict]) -> dict[str, list[dict]]:
    """Sweep rows grouped by setup (first-seen order), each group sorted by rate."""
    names = dict.fromkeys(r["setup"] for r in rows)
    return {n: sorted((r for r in rows if r["setup"] == n), key=lambda r: r["rate"]) for n in names}


def plot_rate_sweep(rows: list[dict], y: str = "e2e_p99_s", ax=None, title: str | None = None):
    """Output throughput (x) against ``y`` (a latency), one line per setup, a point per rate."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    for name, pts in _by_setup(rows).items():
        ax.plot([p["output_throughput_tok_s"] for p in pts], [p[y] for p in pts], ms=4, label=name,
                **_line_style(name))
    ax.set_yscale("log")
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel(y.replace("_s", " (s)").replace("_", " "))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def plot_capacity(rows: list[dict], limit: float, capacity: dict[str, float | None] | None = None,
                  key: str = "normalized_latency_s", ax=None, title: str | None = None):
    """``key`` (normalized latency: mean end-to-end latency per output token, s; log scale) against the
    request rate (requests/s), one line per setup, with ``limit`` as a horizontal line: a setup's capacity
    is where its line crosses it. ``capacity`` (setup -> requests/s, None: over the bound at every rate)
    marks each crossing on the bound and is written in the legend."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    capacity = capacity or {}
    for name, pts in _by_setup(rows).items():
        style, label = _line_style(name), name
        if name in capacity:
            cap = capacity[name]
            label = f"{name}: {cap:.3g} req/s" if cap is not None else f"{name}: over at every rate"
        ax.plot([p["rate"] for p in pts], [p[key] for p in pts], ms=4, label=label, **style)
        if capacity.get(name) is not None:
            ax.plot([capacity[name]], [limit], ls="", marker=style["marker"], ms=9, mfc="none",
                    mec=style["color"] or "black", mew=1.5)
    ax.axhline(limit, color="black", lw=1.2, label=f"bound: {limit:g} s/token")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("normalized latency (s per output token)")
    ax.tick_params(labelsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
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
    for layout, marker, color in (("packed", "o", "#0072B2"), ("padded", "s", "#D55E00")):  # Okabe-Ito
        rows, pred = samples.get(layout, ([], None))
        if rows:
            ax.scatter([r["time_s"] * 1e3 for r in rows], pred * 1e3, s=8, marker=marker, alpha=0.5, label=layout,
                       color=color)
    lim = np.array(ax.get_xlim())
    ax.plot(lim, lim, color="black", lw=0.8)
    ax.fill_between(lim, lim * 0.85, lim * 1.15, color="grey", alpha=0.15, label="+-15%")
    ax.set(xscale="log", yscale="log", xlabel="measured step time (ms)", ylabel="predicted (ms)",
           title="every calibration step, measured vs the fit")
    ax.legend(fontsize=8)
    rows, _ = samples.get("packed", ([], None))
    kinds = {"decode": ("decode batches", "#56B4E9"), "long": ("long context", "#009E73"),
             "prefill": ("one prefill", "#E69F00"), "chunked": ("chunked trace", "#CC79A7")}  # Okabe-Ito
    for kind, (label, color) in kinds.items():
        pts = [r for r in rows if r["scenario"].startswith(kind)]
        ax2.scatter([r["num_tokens"] for r in pts], [r["time_s"] * 1e3 for r in pts], s=8, alpha=0.5, label=label,
                    color=color)
    # curve(N) is one term of the fit: logits and attention add to it, so the measured steps sit above it
    ax2.plot(packed.knots, np.array(packed.curve_s) * 1e3, color="black", lw=1, marker="|",
             label="fitted curve(N) alone\n(+ logits and attention terms\n= a step's predicted time)")
    ax2.set(xscale="log", yscale="log", xlabel="tokens in the step (N)", ylabel="step time (ms)",
            title="packed steps: cost against tokens")
    ax2.legend(fontsize=8)
    return axes


def plot_validation(report: dict, bands: tuple[float, ...] = (0.15, 0.10), ax=None):
    """Simulation error of output throughput and TTFT p50, per trace (a group, named above it) and
    policy (a tick); ``bands`` (fractions) are drawn as +- lines, dashed then dotted, and named in the legend."""
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 4), layout="constrained")
    labels, thr, ttft, groups = [], [], [], []
    for name, t in report["traces"].items():
        groups.append((name.split("-seed")[0], len(labels), len(labels) + len(t["policies"]) - 1))
        for r in t["policies"]:
            labels.append(r["policy"])
            thr.append(r["error"]["output_throughput_tok_s"] * 100)
            ttft.append(r["error"]["ttft_p50_s"] * 100)
    x = np.arange(len(labels))
    ax.bar(x - 0.2, thr, 0.4, label="output throughput", color="#0072B2")
    ax.bar(x + 0.2, ttft, 0.4, label="TTFT p50", color="#E69F00", hatch="//", edgecolor="white")
    for band, ls in zip(bands, ("--", ":", "-.")):
        for sign in (1, -1):
            ax.axhline(sign * band * 100, color="grey", ls=ls, lw=0.9, label=f"±{band:.0%}" if sign > 0 else None)
    top = max(thr + ttft + [b * 100 for b in bands]) * 1.25
    ax.set_ylim(top=top)
    for name, first, last in groups:
        ax.text((first + last) / 2, top * 0.97, name, ha="center", va="top", fontsize=9)
        if first:
            ax.axvline(first - 0.5, color="black", lw=0.6)
    ax.set_xticks(x, labels, fontsize=8, rotation=90)
    ax.tick_params(axis="y", labelsize=9)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_ylabel("simulated vs measured (%)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return ax
