"""Speculative decoding figures (notebook 06): the sampler's distribution, one request's draft and
verify phases, and speedup against the acceptance rate or the batch size. Each returns its Axes."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from minibatch.records import StepRecord

# One Okabe-Ito colour and one marker per curve (k = 1, 2, 4, 6, ... in order): two cues, colour-blind safe.
CURVE_STYLES = (("#0072B2", "o"), ("#E69F00", "s"), ("#009E73", "^"), ("#CC79A7", "D"), ("#D55E00", "v"),
                ("#56B4E9", "P"))


def plot_distribution(hist: dict, ax=None, title: str | None = None):
    """Bars: the target's next-token distribution, the draft's, and what each sampler produced
    (``hist``: {"target": p, "draft": q, "samplers": {name: {"first_token", "p_value"}}})."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2), layout="constrained")
    V = len(hist["target"])
    series = [("target p", hist["target"], "#000000"), ("draft q", hist["draft"], "#BBBBBB")] + [
        (f"{name} (chi-square p = {v['p_value']:.2g})", v["first_token"], c)
        for (name, v), c in zip(hist["samplers"].items(), ("#009E73", "#D55E00", "#0072B2"))]
    w = 0.8 / len(series)
    for i, (label, ys, color) in enumerate(series):
        ax.bar(np.arange(V) + (i - (len(series) - 1) / 2) * w, ys, w, label=label, color=color)
    ax.set_xlabel("first token")
    ax.set_ylabel("probability")
    ax.set_xticks(range(V))
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def plot_spec_timeline(trace: list[StepRecord], request_id: str, ax=None, max_steps: int | None = None,
                       title: str | None = None):
    """One request's steps on the time axis (s): each step's draft phase (grey) then its verify
    forward (blue); above it, one square per draft token, green if accepted, red if rejected,
    and the extra token every verification emits (dark)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.6), layout="constrained")
    steps = [(rec, e) for rec in trace for e in rec.entries if e.request_id == request_id]
    steps = steps[:max_steps] if max_steps else steps
    for rec, e in steps:
        d = rec.draft_time_s if e.num_spec_tokens else 0.0
        ax.broken_barh([(rec.start_s, d)], (0, 0.8), color="#999999")
        ax.broken_barh([(rec.start_s + d, rec.duration_s - d)], (0, 0.8),
                       color="#E69F00" if e.phase == "prefill" else "#56B4E9")
        slot = rec.duration_s / max(e.num_spec_tokens + 1, 1)
        for i in range(e.num_spec_tokens):
            ax.broken_barh([(rec.start_s + i * slot, slot * 0.9)], (1.0, 0.6),
                           color="#009E73" if i < e.num_accepted_tokens else "#D55E00")
        if e.sampled:
            i = e.num_accepted_tokens if e.num_spec_tokens else 0
            ax.broken_barh([(rec.start_s + i * slot, slot * 0.9)], (1.0, 0.6), color="#000000")
    ax.set_yticks([0.4, 1.3], ["forward", "tokens"])
    ax.set_xlabel("time (s)")
    ax.legend(handles=[Patch(color="#999999", label="draft (k steps of the draft model)"),
                       Patch(color="#56B4E9", label="verify (one target forward, k+1 tokens)"),
                       Patch(color="#E69F00", label="prefill"),
                       Patch(color="#009E73", label="draft token accepted"),
                       Patch(color="#D55E00", label="draft token rejected"),
                       Patch(color="#000000", label="target's token (bonus or correction)")],
              fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(0, -0.35))
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def plot_speedup_curves(curves: dict[str, tuple], ax=None, measured: list[tuple[float, float, str]] = (),
                        xlabel: str = "acceptance rate (alpha)", title: str | None = None):
    """Speedup curves, ``curves``: label -> (xs, speedups), e.g. predicted batch-1 speedup against
    the acceptance rate for each k; ``measured`` (x, speedup, label) points on top as stars."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
    for (label, (xs, ys)), (color, marker) in zip(curves.items(), CURVE_STYLES * len(curves)):
        ax.plot(xs, ys, label=label, color=color, marker=marker, markevery=max(len(xs) // 6, 1), ms=4)
    for a, sp, label in measured:
        ax.plot(a, sp, "k*", ms=10)
        ax.annotate(label, (a, sp), xytext=(5, -12), textcoords="offset points", fontsize=8)
    return speedup_axes(ax, xlabel, title)


def plot_speedup_vs_batch(rows: list[dict], ax=None, measured: list[dict] | None = None, title: str | None = None):
    """Speedup vs batch size, one line per k (rows: {batch_size, k, speedup}); the dashed line is 1
    (no gain). ``measured`` rows ({batch_size, speedup, label}) are drawn as points."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
    for k, (color, marker) in zip(sorted({r["k"] for r in rows}), CURVE_STYLES * len(rows)):
        pts = [(r["batch_size"], r["speedup"]) for r in rows if r["k"] == k]
        ax.plot(*zip(*pts), marker=marker, color=color, label=f"simulated, k={k}")
    for m in measured or []:
        ax.plot(m["batch_size"], m["speedup"], "k*", ms=10)
    if measured:
        ax.plot([], [], "k*", label=measured[0].get("label", "measured"))
    ax.set_xscale("log", base=2)
    return speedup_axes(ax, "batch size (requests decoding together)", title)


def speedup_axes(ax, xlabel: str, title: str | None):
    """The speedup plots' common finish: the no-gain line at 1, labels, legend, title."""
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax
