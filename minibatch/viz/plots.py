"""Plots of a schedule trace and of benchmark results (matplotlib; no backend is chosen here).

* :func:`gantt`: the schedule picture of the Orca paper (Yu et al., OSDI'22): one row per batch
  row (or per request), one column per step (or the step's time span), each cell colored by
  what that row did in that step. :func:`compare_gantt` stacks policies on one x axis.
* the policy comparisons (latency CDFs, throughput bars) are in ``minibatch.viz.results``.
* :func:`save`: ``figures/NAME.png``.
"""

from __future__ import annotations

import bisect
import math
import re
from pathlib import Path
from typing import NamedTuple

import matplotlib.pyplot as plt
from matplotlib.collections import PolyCollection
from matplotlib.patches import Patch

from minibatch.engine import StepRecord
from minibatch.request import Request

# Okabe-Ito colors (colorblind-safe), fixed once so every notebook's figures agree.
PALETTE = {
    "prefill": "#E69F00",  # orange
    "chunk": "#E69F00",  # orange, dotted: a prefill chunk that does not finish the prompt (no token)
    "decode": "#56B4E9",  # sky blue
    "padding": "#D55E00",  # vermillion, hatched: a finished request still holding a static row
    "idle": "#EBEBEB",  # light grey: an empty batch row
    "waiting": "#F0E442",  # yellow: arrived, not scheduled
    "finished": "#F5F5F5",  # near white: done and gone (request rows only)
}
HATCH = {"padding": "////", "chunk": "..."}
KV_COLORS = {"used": "#0072B2", "reserved": "#CC79A7"}  # blue, reddish purple: the KV strip under a Gantt
MERGE_ABOVE_STEPS = 150  # wider traces draw runs of cells as one rectangle (cells < ~5 px)
CELL_KINDS = tuple(PALETTE)


class Cell(NamedTuple):
    """One colored cell of a Gantt chart: row index, x span, kind (a PALETTE key), request."""

    row: int
    x0: float
    width: float
    kind: str
    request_id: str | None = None


def short_id(request_id: str) -> str:
    """The cell label of a request: "req-007" -> "7"; a conversation's turn "conv-007-t2" -> "7.2"; an id with no
    trailing number -> its first 4 characters."""
    turn = re.fullmatch(r"\D*?0*(\d+)-t(\d+)", request_id)
    if turn:
        return f"{turn.group(1)}.{turn.group(2)}"
    m = re.fullmatch(r"\D*?0*(\d+)", request_id)
    return m.group(1) if m else request_id[:4]


def row_names(trace: list[StepRecord], rows: str = "row", requests: list[Request] | None = None) -> list[str]:
    """Gantt row names, top first: "row 0".. (up to the largest batch row used) or request ids
    (``requests`` order, then first appearance).
    Raises ValueError unless rows is "row" or "request"."""
    if rows not in ("row", "request"):
        raise ValueError(f"rows must be 'row' or 'request', got {rows!r}")
    if rows == "row":
        # slots ever used: a large max_num_seqs that KV memory never lets fill would be rows of idle noise
        num_rows = max([e.row + 1 for r in trace for e in r.entries] + [1])
        return [f"row {i}" for i in range(num_rows)]
    ids = {r.request_id: None for r in requests or []}  # an ordered set
    ids.update((e.request_id, None) for record in trace for e in record.entries)
    return list(ids)


def gantt_cells(trace: list[StepRecord], rows: str = "row", x: str = "step",
                requests: list[Request] | None = None) -> tuple[list[Cell], list[str]]:
    """The cells :func:`gantt` draws, and the row names (see :func:`row_names`).

    rows="row": one Gantt row per batch row; a row with no request in a step is "idle".
    rows="request": one row per request; with ``requests``, one "waiting" cell spans the steps
    from its arrival to its first step (x="time": from arrival_time_s) and one "finished" cell
    the steps after its last one. x="step" (unit-wide columns) or "time" (start_s..end_s).

    Raises:
        ValueError: rows or x not one of the allowed names.
    """
    if x not in ("step", "time"):
        raise ValueError(f"x must be 'step' or 'time', got {x!r}")
    names = row_names(trace, rows, requests)
    row_of = {name: i for i, name in enumerate(names)}
    spans = [(r.step, 1.0) if x == "step" else (r.start_s, r.duration_s) for r in trace]
    cells: list[Cell] = []
    last_step: dict[str, int] = {}  # request_id -> index of its last step
    for i, (record, (x0, width)) in enumerate(zip(trace, spans)):
        for e in record.entries:
            row = e.row if rows == "row" else row_of[e.request_id]
            cells.append(Cell(row, x0, width, "chunk" if e.is_chunk else e.phase, e.request_id))
            last_step[e.request_id] = i
        if rows == "row":
            busy = {e.row for e in record.entries}
            cells += [Cell(s, x0, width, "idle") for s in range(len(names)) if s not in busy]
    if rows == "row" or not trace:
        return cells, names
    starts = [r.start_s for r in trace]
    end_s = trace[-1].end_s
    for r in requests or []:
        row = row_of[r.request_id]
        done = last_step[r.request_id] + 1 if r.request_id in last_step else len(trace)
        first_s = r.first_scheduled_time_s if r.first_scheduled_time_s is not None else end_s
        if x == "step":  # the steps that start at/after arrival and before the first scheduled one
            waiting = (bisect.bisect_left(starts, r.arrival_time_s), bisect.bisect_left(starts, first_s))
            spans = [("waiting", *waiting), ("finished", done, len(trace))]
            cells += [Cell(row, trace[a].step, trace[b - 1].step + 1 - trace[a].step, kind, r.request_id)
                      for kind, a, b in spans if a < b]
        else:  # from the arrival itself: the engine may idle meanwhile (static batching's max wait)
            spans = [("waiting", r.arrival_time_s, first_s),
                     ("finished", trace[done - 1].end_s if done < len(trace) else end_s, end_s)]
            cells += [Cell(row, x0, x1 - x0, kind, r.request_id) for kind, x0, x1 in spans if x0 < x1]
    return cells, names


def gantt(trace: list[StepRecord], ax=None, rows: str = "row", x: str = "step",
          title: str | None = None, requests: list[Request] | None = None, legend: bool = True,
          merge: bool | None = None, kv: bool = True):
    """Draw the schedule: rows = batch rows or requests, columns = steps (or time).

    Cells: prefill, decode, padding (hatched; a finished request still occupying a static
    batch row), idle (rows="row": an empty batch row), waiting and finished (rows="request" with
    ``requests`` given). In batch rows each run of one request is labelled with its short id
    when it fits. One PolyCollection per kind, its gid the kind name, one path per cell;
    ``merge`` (default: when there are more than MERGE_ABOVE_STEPS steps, too narrow to see
    one cell) draws each run of equal adjacent cells as one rectangle instead. Without ``ax``, a new figure
    with a :func:`kv_usage` strip under the chart when ``kv`` (its axes is ``fig.axes[1]``). Returns the Axes.
    """
    cells, names = gantt_cells(trace, rows, x, requests)
    if merge is None:
        merge = len(trace) > MERGE_ABOVE_STEPS
    if merge:
        cells = [Cell(r[0].row, r[0].x0, r[-1].x0 + r[-1].width - r[0].x0, r[0].kind, r[0].request_id)
                 for r in _runs(cells, lambda c: (c.kind, c.request_id))]
    x_end = (trace[-1].step + 1 if x == "step" else trace[-1].end_s) if trace else 1.0
    if ax is None:
        height = min(10, 1.2 + 0.3 * len(names))
        fig, axes = plt.subplots(1 + kv, 1, sharex=True, squeeze=False, layout="constrained",
                                 figsize=(min(14, 5 + 0.12 * len(trace)), height + 1.1 * kv),
                                 gridspec_kw={"height_ratios": [height, 1.1][:1 + kv]})
        ax = axes[0, 0]
        if kv:
            kv_usage(trace, axes[1, 0], x=x)
            ax.set_xlabel("")
    pad = 0.06  # gap between rows, in row heights
    for kind in CELL_KINDS:
        verts = [[(c.x0, c.row + pad), (c.x0 + c.width, c.row + pad),
                  (c.x0 + c.width, c.row + 1 - pad), (c.x0, c.row + 1 - pad)]
                 for c in cells if c.kind == kind]
        if verts:
            ax.add_collection(PolyCollection(verts, facecolors=PALETTE[kind], edgecolors="white",
                                             linewidths=0.4, hatch=HATCH.get(kind), gid=kind))
    ax.set_xlim(0 if x == "step" else min((r.start_s for r in trace), default=0.0), x_end)
    ax.set_ylim(len(names), 0)  # first row on top
    step_ticks = max(1, len(names) // 30 + (len(names) % 30 > 0))
    ax.set_yticks([i + 0.5 for i in range(0, len(names), step_ticks)],
                  names[::step_ticks], fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("step" if x == "step" else "time (s)")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    if rows == "row":
        _label_runs(ax, cells, x_end - ax.get_xlim()[0], len(names))
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    if legend:
        kinds = [k for k in CELL_KINDS if any(c.kind == k for c in cells)]
        ax.legend(handles=legend_handles(kinds), loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  fontsize=8, frameon=False)
    return ax


def kv_usage(trace: list[StepRecord], ax, x: str = "step", legend: bool = True):
    """The KV cache strip drawn under a Gantt chart: per step, the KV slots holding computed tokens
    (``num_kv_slots_used``, filled) and those set aside (``num_kv_slots_reserved``, hatched outline; Orca and
    static batching reserve prompt + max_new_tokens, a paged cache only whole blocks). x as in :func:`gantt`."""
    x0 = [r.step if x == "step" else r.start_s for r in trace]
    width = [1.0 if x == "step" else r.end_s - r.start_s for r in trace]
    ax.bar(x0, [r.num_kv_slots_reserved for r in trace], width, align="edge", color="white",
           edgecolor=KV_COLORS["reserved"], hatch="///", linewidth=0.6, label="KV slots reserved")
    ax.bar(x0, [r.num_kv_slots_used for r in trace], width, align="edge", color=KV_COLORS["used"],
           linewidth=0, label="KV slots used")
    ax.set_ylabel("KV slots", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_xlabel("step" if x == "step" else "time (s)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if legend:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def legend_handles(kinds=CELL_KINDS, labels: dict[str, str] | None = None) -> list[Patch]:
    """Legend patches for Gantt cell kinds (for a figure-level legend); ``labels`` renames kinds."""
    return [Patch(facecolor=PALETTE[k], edgecolor="#999999", hatch=HATCH.get(k), label=(labels or {}).get(k, k))
            for k in kinds]


def _runs(cells: list[Cell], key) -> list[list[Cell]]:
    """Group cells into runs: same row, same key(cell), each starting where the last one ends."""
    runs: list[list[Cell]] = []
    for c in sorted(cells, key=lambda c: (c.row, c.x0)):
        last = runs[-1][-1] if runs else None
        if last and last.row == c.row and key(last) == key(c) and math.isclose(last.x0 + last.width, c.x0):
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs


def _label_runs(ax, cells: list[Cell], x_span: float, num_rows: int) -> None:
    """Write the short request id on each run of one request's prefill/decode cells in a row."""
    fig = ax.figure
    bbox = ax.get_position()  # axes box in figure fractions
    px_per_x = bbox.width * fig.get_figwidth() * fig.dpi / max(x_span, 1e-12)
    row_px = bbox.height * fig.get_figheight() * fig.dpi / max(num_rows, 1)
    fontsize = min(9.0, row_px * 0.55 * 72 / fig.dpi)
    if fontsize < 4:
        return
    for run in _runs([c for c in cells if c.kind in ("prefill", "decode")], lambda c: c.request_id):
        label = short_id(run[0].request_id)
        x0, x1 = run[0].x0, run[-1].x0 + run[-1].width
        if (x1 - x0) * px_per_x >= (len(label) * 0.62 + 0.6) * fontsize * fig.dpi / 72:
            ax.text((x0 + x1) / 2, run[0].row + 0.5, label, ha="center", va="center",
                    fontsize=fontsize, color="black", clip_on=True)


def compare_gantt(traces: dict[str, list[StepRecord]], rows: str = "row", x: str = "step",
                  requests: dict[str, list[Request]] | None = None, width: float = 12.0, kv: bool = True,
                  labels: dict[str, str] | None = None):
    """One :func:`gantt` per policy, stacked on a shared x axis (e.g. static over orca), each with a
    :func:`kv_usage` strip under it when ``kv``; one legend of every cell kind drawn (``labels`` renames kinds).

    Returns the Figure; its axes are ``fig.axes``: each policy's Gantt, then its KV strip (legends once).
    """
    num_rows = [len(row_names(t, rows, (requests or {}).get(n))) for n, t in traces.items()]
    ratios = [r for n in num_rows for r in ([max(n, 1) + 2, 3] if kv else [max(n, 1) + 2])]
    fig, axes = plt.subplots(len(ratios), 1, sharex=True, layout="constrained", squeeze=False,
                             figsize=(width, sum(min(6.0, 1.0 + 0.3 * n) + 0.9 * kv for n in num_rows)),
                             gridspec_kw={"height_ratios": ratios})
    kinds = set()
    for i, (name, trace) in enumerate(traces.items()):
        ax = axes[(1 + kv) * i, 0]
        gantt(trace, ax=ax, rows=rows, x=x, title=name, requests=(requests or {}).get(name), legend=False)
        kinds |= {c.get_gid() for c in ax.collections}
        if kv:
            kv_usage(trace, axes[2 * i + 1, 0], x=x, legend=i == 0)
    if kv:  # one y scale, so the strips compare memory across policies
        top = max((max(r.num_kv_slots_reserved, r.num_kv_slots_used) for t in traces.values() for r in t), default=1)
        for ax in axes[1::2, 0]:
            ax.set_ylim(0, top * 1.05)
    axes[0, 0].legend(handles=legend_handles([k for k in CELL_KINDS if k in kinds], labels), loc="upper left",
                      bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)  # every policy's kinds, once
    for ax in axes[:-1, 0]:
        ax.set_xlabel("")
    axes[-1, 0].set_xlabel("step" if x == "step" else "time (s)")
    ends = [t[-1].step + 1 if x == "step" else t[-1].end_s for t in traces.values() if t]
    axes[0, 0].set_xlim(0, max(ends, default=1.0))
    return fig


def save(fig, name: str, figures_dir: str | Path = "figures") -> Path:
    """Write ``figures_dir/NAME.png`` (dpi 120, tight box), creating the folder; returns the path.
    Atomic like every minibatch output (``minibatch.files``): a failed write keeps the old PNG."""
    import io

    from minibatch.files import atomic_write_bytes

    path = Path(figures_dir) / (name if name.endswith(".png") else f"{name}.png")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    return atomic_write_bytes(path, buf.getvalue())


def show(fig, name: str, figures_dir: str | Path = "figures") -> Path:
    """:func:`save` the figure, close it, print the path and display the PNG just written (in a notebook: the
    inline image is the committed file, byte for byte, not a second rendering). Returns the path."""
    from IPython.display import Image, display
    import matplotlib.pyplot as plt

    path = save(fig, name, figures_dir)
    plt.close(fig)
    print(path)
    display(Image(data=path.read_bytes(), format="png"))
    return path
