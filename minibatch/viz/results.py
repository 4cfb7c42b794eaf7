"""Plots that compare policies' results: latency CDFs and throughput / TTFT bars, one color per
policy in every figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from minibatch.metrics import BenchmarkSummary, request_metrics
from minibatch.request import Request

# Policies keep one color in every figure; other names take the next free color in order.
POLICY_COLORS = {"static": "#D55E00", "orca": "#0072B2", "paged": "#009E73", "chunked": "#CC79A7"}
EXTRA_COLORS = ("#E69F00", "#56B4E9", "#000000", "#F0E442")
UNITS = {"ttft": ("TTFT", "s", 1.0), "e2e": ("E2E latency", "s", 1.0),
         "tpot": ("TPOT", "ms", 1e3), "itl": ("ITL", "ms", 1e3)}


def policy_colors(names) -> dict[str, str]:
    """A color per policy name: the fixed POLICY_COLORS where a name has one, else the unused ones."""
    free = [c for c in POLICY_COLORS.values() if c not in {POLICY_COLORS.get(n) for n in names}]
    free = free + list(EXTRA_COLORS)
    unknown = [n for n in names if n not in POLICY_COLORS]
    return {n: POLICY_COLORS.get(n) or free[unknown.index(n) % len(free)] for n in names}


def latency_cdf(results: dict[str, list[Request]], metric: str = "ttft", ax=None):
    """Empirical CDF of a latency per policy (``results``: policy name -> finished requests).

    metric: "ttft" or "e2e" (seconds), "tpot" or "itl" (milliseconds); 1-token outputs have no
    TPOT and are left out. Returns the Axes. Raises ValueError for an unknown metric.
    """
    if metric not in UNITS:
        raise ValueError(f"metric must be one of {tuple(UNITS)}, got {metric!r}")
    label, unit, scale = UNITS[metric]
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    colors = policy_colors(results)
    for name, requests in results.items():
        ms = request_metrics(requests)
        if metric == "itl":
            values = [g for m in ms for g in m.itl_s]
        else:
            values = [getattr(m, f"{metric}_s") for m in ms if getattr(m, f"{metric}_s") is not None]
        values = np.sort(np.asarray(values, dtype=float) * scale)
        if len(values):
            ax.step(np.concatenate([[values[0]], values]), np.arange(len(values) + 1) / len(values),
                    where="post", color=colors[name], label=name, linewidth=1.8)
    ax.set_xlabel(f"{label} ({unit})")
    ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of token gaps")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    return ax


def throughput_latency_bars(summaries: dict[str, BenchmarkSummary], ax=None):
    """Output throughput (left) and TTFT p50 / p99 (right) per policy.

    ax: None (a new 1x2 figure) or a pair of Axes. Returns the two Axes.
    """
    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    ax_tput, ax_ttft = ax
    names = list(summaries)
    colors = [policy_colors(names)[n] for n in names]
    pos = np.arange(len(names))
    tput = [summaries[n].output_throughput_tok_s for n in names]
    bars = ax_tput.bar(pos, tput, color=colors)
    ax_tput.bar_label(bars, fmt="%.0f", fontsize=8)
    ax_tput.set_ylabel("output throughput (tok/s)")
    w = 0.38
    for offset, stat, hatch in ((-w / 2, "p50", None), (w / 2, "p99", "///")):
        vals = [getattr(summaries[n], f"ttft_{stat}_s") or 0.0 for n in names]
        b = ax_ttft.bar(pos + offset, vals, w, color=colors, hatch=hatch, edgecolor="white")
        ax_ttft.bar_label(b, fmt="%.2f", fontsize=8)
    ax_ttft.legend(handles=[Patch(facecolor="#888888", label="TTFT p50"),
                            Patch(facecolor="#888888", hatch="///", edgecolor="white", label="TTFT p99")],
                   frameon=False, fontsize=8)
    ax_ttft.set_ylabel("TTFT (s)")
    for a in (ax_tput, ax_ttft):
        a.set_xticks(pos, names, rotation=20, ha="right")
        a.margins(y=0.15)
        for side in ("top", "right"):
            a.spines[side].set_visible(False)
    return ax_tput, ax_ttft
