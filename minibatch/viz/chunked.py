"""Chunked prefill figures (notebook 05): every token's gap on the time axis, the schedule as Gantt charts,
each step's split of its token budget between decodes and prefill chunks, and the ITL / TTFT / throughput
trade-off of a budget sweep. Each returns its Axes (or Figure); times are seconds, drawn in ms where labelled."""

from __future__ import annotations

import matplotlib.pyplot as plt

from minibatch.records import StepRecord
from minibatch.request import Request
from minibatch.viz.plots import HATCH, PALETTE, compare_gantt
from minibatch.viz.results import policy_colors

LABELS = {"prefill_first": "prefill-first (vLLM v0)", "paged": "mixed, whole prefills (Orca-style)",
          "chunked": "chunked prefill (Sarathi-Serve)"}
CELL_LABELS = {"prefill": "prefill reaching the prompt's end", "chunk": "prefill chunk (no token yet)"}
ADAPTIVE_COLOR, ADAPTIVE_MARKERS = "#000000", "DXpho"


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


def plot_stall_gantt(traces: dict[str, list[StepRecord]], **kwargs):
    """:func:`minibatch.viz.plots.compare_gantt` with requests as rows on the time axis, its legend saying which
    prefill cells sample a token (CELL_LABELS). kwargs go to compare_gantt. Returns the Figure."""
    return compare_gantt(traces, rows="request", x="time", labels=CELL_LABELS, **kwargs)


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
    ax.set_ylim(0, 1.45 * max([budget or 0] + bottom))  # headroom: the budget line and the legend clear the top
    ax.set_xlabel("step")
    ax.set_ylabel("tokens in the step")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right", ncols=2)
    return ax


def plot_tradeoff(rows: list[dict], axes=None, title: str | None = None):
    """Left: TTFT p50 (s) against ITL p99 (ms, log scale), one point per run: the fixed budgets as a line
    labelled with each budget, the baselines as large markers, each adaptive run its own marker labelled with
    its target ITL. Small budgets buy a low ITL p99 with later first tokens. Right: output throughput per run,
    coloured as on the left. Returns the two Axes."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    ax, bx = axes
    baselines = [r for r in rows if r["budget"] is None]
    colors = policy_colors([r["policy"] for r in baselines] + ["chunked"])
    fixed = [r for r in rows if isinstance(r["budget"], int)]
    ax.plot([r["itl_p99_s"] * 1e3 for r in fixed], [r["ttft_p50_s"] for r in fixed], "o-",
            color=colors["chunked"], label="chunked, fixed budget (labelled)")
    for r in fixed:
        ax.annotate(str(r["budget"]), (r["itl_p99_s"] * 1e3, r["ttft_p50_s"]), xytext=(4, 4),
                    textcoords="offset points", fontsize=8)
    for r, marker in zip(baselines, "*Ps"):
        ax.plot(r["itl_p99_s"] * 1e3, r["ttft_p50_s"], marker, ms=12, color=colors[r["policy"]],
                label=LABELS.get(r["policy"], r["policy"]))
    adaptive = [r for r in rows if r["budget"] == "adaptive"]
    for r, marker in zip(adaptive, ADAPTIVE_MARKERS):
        target = f"target ITL {r['target_itl_s'] * 1e3:g} ms"
        ax.plot(r["itl_p99_s"] * 1e3, r["ttft_p50_s"], marker, ms=8, color=ADAPTIVE_COLOR,
                label=f"adaptive chunk size, {target}")
        ax.annotate(target, (r["itl_p99_s"] * 1e3, r["ttft_p50_s"]), xytext=(-8, -12), textcoords="offset points",
                    ha="right", fontsize=8)
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    ticks = [t for t in (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000) if lo <= t <= hi]
    if len(ticks) < 4:  # a narrow range: 1-1.5-2-3-5-7 steps
        ticks = [m * d for d in (10, 100, 1000) for m in (1, 1.5, 2, 3, 5, 7) if lo <= m * d <= hi]
    ticks = [int(t) for t in ticks]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("ITL p99 (ms, log scale)")
    ax.set_ylabel("TTFT p50 (s)")
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=8)
    run_color = {r["policy"]: colors[r["policy"]] for r in baselines}
    run_color.update({r["policy"]: colors["chunked"] for r in fixed} | {r["policy"]: ADAPTIVE_COLOR for r in adaptive})
    bx.bar(range(len(rows)), [r["output_throughput_tok_s"] for r in rows],
           color=[run_color.get(r["policy"], "#56B4E9") for r in rows])
    bx.set_xticks(range(len(rows)), [r["policy"] for r in rows], rotation=45, ha="right", fontsize=8)
    bx.tick_params(axis="y", labelsize=8)
    bx.set_ylabel("output throughput (tok/s)")
    if title:
        ax.figure.suptitle(title, fontsize=10)
    return ax, bx
