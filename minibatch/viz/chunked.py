"""Chunked prefill figures (notebook 05): every token's gap on the time axis, each step's split of
its token budget between decodes and prefill chunks, and the TTFT / TPOT / throughput trade-off
of a budget sweep. Each returns its Axes; times are seconds, drawn in ms where labelled."""

from __future__ import annotations

import matplotlib.pyplot as plt

from minibatch.records import StepRecord
from minibatch.request import Request
from minibatch.viz.plots import HATCH, PALETTE
from minibatch.viz.results import policy_colors

LABELS = {"prefill_first": "prefill-first (vLLM v0)", "paged": "mixed, whole prefills (Orca-style)",
          "chunked": "chunked prefill (Sarathi-Serve)"}


def itl_points(requests: list[Request]) -> list[tuple[float, float, str]]:
    """(time the token came out, gap since the request's previous token, request_id), seconds,
    for every token after each request's first, sorted by time."""
    pts = [(b, b - a, r.request_id) for r in requests for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    return sorted(pts)


def plot_itl_timeline(runs: dict[str, list[Request]], ax=None, mark_s: float | None = None,
                      mark_label: str = "long prompt arrives"):
    """ITL (ms) of every token against the time it came out, one marker style per run; a long
    prompt's prefill shows as a spike shared by every decoding request. Returns the Axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5), layout="constrained")
    colors = policy_colors(list(runs))
    for (name, reqs), marker in zip(runs.items(), "os^vD"):
        pts = itl_points(reqs)
        ax.plot([t for t, _, _ in pts], [g * 1e3 for _, g, _ in pts], marker, ms=4, alpha=0.7,
                color=colors[name], label=LABELS.get(name, name))
    if mark_s is not None:
        ax.axvline(mark_s, color="grey", ls=":", lw=1)
        ax.annotate(mark_label, (mark_s, ax.get_ylim()[1]), xytext=(4, -12), textcoords="offset points",
                    fontsize=8, color="grey")
    ax.set_xlabel("time the token came out (s)")
    ax.set_ylabel("ITL (ms)")
    ax.legend(fontsize=8)
    return ax


def budget_split(trace: list[StepRecord]) -> dict[str, list[int]]:
    """Per step: decode tokens, tokens of prefills that finish their prompt, and tokens of
    prefill chunks that do not (``StepEntry.is_chunk``)."""
    out = {"decode": [], "prefill": [], "chunk": []}
    for rec in trace:
        out["decode"].append(sum(e.num_new_tokens for e in rec.entries if e.phase == "decode"))
        out["prefill"].append(sum(e.num_new_tokens for e in rec.entries if e.phase == "prefill" and not e.is_chunk))
        out["chunk"].append(sum(e.num_new_tokens for e in rec.entries if e.is_chunk))
    return out


def plot_budget_split(trace: list[StepRecord], budget: int | None = None, ax=None, title: str | None = None):
    """Stacked bars per step: decodes, then prefill chunks, then prefills that finish a prompt,
    with the token budget as a line. Returns the Axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3), layout="constrained")
    split = budget_split(trace)
    steps = list(range(len(trace)))
    bottom = [0] * len(trace)
    for kind, label in (("decode", "decode tokens"), ("chunk", "prefill chunk (no token yet)"),
                        ("prefill", "prefill reaching the prompt's end")):
        ax.bar(steps, split[kind], bottom=bottom, width=1.0, color=PALETTE[kind], hatch=HATCH.get(kind),
               edgecolor="white", linewidth=0.3, label=label)
        bottom = [b + v for b, v in zip(bottom, split[kind])]
    if budget is not None:
        ax.axhline(budget, color="black", ls="--", lw=1, label=f"token budget {budget}")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens in the step")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    return ax


def plot_tradeoff(rows: list[dict], axes=None, title: str | None = None):
    """Left: TTFT p50 (s) against TPOT p99 (ms), one point per budget, the baselines as stars:
    small budgets buy low TPOT with later first tokens. Right: output throughput per run.
    Returns the two Axes."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    ax, bx = axes
    chunked = [r for r in rows if isinstance(r["budget"], int)]
    ax.plot([r["tpot_p99_s"] * 1e3 for r in chunked], [r["ttft_p50_s"] for r in chunked], "o-",
            color="#CC79A7", label="chunked, fixed budget")
    for r in chunked:
        ax.annotate(str(r["budget"]), (r["tpot_p99_s"] * 1e3, r["ttft_p50_s"]), xytext=(4, 4),
                    textcoords="offset points", fontsize=8)
    for r, marker in zip([r for r in rows if r["budget"] is None], "*P"):
        ax.plot(r["tpot_p99_s"] * 1e3, r["ttft_p50_s"], marker, ms=12, label=LABELS.get(r["policy"], r["policy"]))
    for r in [r for r in rows if r["budget"] == "adaptive"]:
        ax.plot(r["tpot_p99_s"] * 1e3, r["ttft_p50_s"], "D", ms=8, color="#009E73", label=r["policy"])
    ax.set_xlabel("TPOT p99 (ms)")
    ax.set_ylabel("TTFT p50 (s)")
    ax.legend(fontsize=8)
    names = [r["policy"] for r in rows]
    bx.bar(range(len(rows)), [r["output_throughput_tok_s"] for r in rows], color="#56B4E9")
    bx.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=8)
    bx.set_ylabel("output throughput (tok/s)")
    if title:
        ax.figure.suptitle(title, fontsize=10)
    return ax, bx
