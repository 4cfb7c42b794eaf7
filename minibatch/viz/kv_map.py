"""The KV block map: which request holds which KV block in each engine step.

A paged KV cache (vLLM, Kwon et al., SOSP'23, §4.1-4.3) gives each request a ``block_table`` of
physical block ids anywhere in the cache. Drawn over steps, the picture shows blocks being
taken on admission (or one by one as decode fills them), returned when a request finishes, and
reused by the next request, in any order, with no holes to compact.

    block id
       0  | A A A A . . C C C
       1  | A A A A B B B B .      x = step, y = block id,
       2  | . B B B B B B . .      a colour per request, white = free,
       3  | # # # # . . . . .      # = shared by several requests (prefix caching, copy-on-write)
          +------------------> step

* :func:`block_map_array`: the map as a (num_steps, num_blocks) array of owner indices.
* :func:`kv_block_map`: draws it (matplotlib; no backend is chosen here).
* :func:`request_colors`: one colour per request id, shared with ``minibatch.lessons.contiguous``.
"""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from minibatch.engine import StepRecord

FREE = -1  # block_map_array value: no request holds the block this step
SHARED = -2  # block_map_array value: two or more requests hold it (prefix cache / copy-on-write)
SHARED_COLOR = "#4D4D4D"  # dark grey, cross-hatched
SHARED_HATCH = "xxxx"
MAX_LEGEND_REQUESTS = 16  # more entries than this crowd the figure; the legend is left out
# Okabe-Ito's colour-blind-safe hues (black left out: shared blocks are dark grey); request i takes colour i % 7
REQUEST_COLORMAP = ListedColormap(["#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7"],
                                  name="okabe_ito")


def natural_key(request_id: str) -> list:
    """Sort key that orders "req-2" before "req-10" (digit runs compare as numbers)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in re.split(r"(\d+)", request_id) if part]


def request_colors(request_ids) -> dict[str, tuple]:
    """request_id -> RGBA colour: ids in natural sorted order take the colours of the
    qualitative colormap REQUEST_COLORMAP in turn, cycling after 7. The same set of ids always
    gets the same colours, whatever order they arrive in."""
    cmap = REQUEST_COLORMAP
    return {rid: cmap(i % cmap.N) for i, rid in enumerate(sorted(set(request_ids), key=natural_key))}


def block_map_array(trace: list[StepRecord], num_blocks: int) -> tuple[np.ndarray, list[str]]:
    """The owner of every KV block in every step of ``trace``.

    Returns ``(owners, request_ids)``: ``owners`` has shape (num_steps, num_blocks), one row per
    record in trace order; ``owners[i, b]`` is the index in ``request_ids`` of the request whose
    block_table holds block ``b`` in record ``i``, FREE (-1) when none does and SHARED (-2)
    when two or more do. ``request_ids``: every request that holds a block anywhere in the
    trace, in natural sorted order ("req-2" before "req-10").

    Raises:
        ValueError: num_blocks < 1, or a block id outside [0, num_blocks).
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    request_ids = sorted({rid for r in trace for rid, table in r.block_tables.items() if table},
                         key=natural_key)
    index = {rid: i for i, rid in enumerate(request_ids)}
    owners = np.full((len(trace), num_blocks), FREE, dtype=np.int64)  # (num_steps, num_blocks)
    for i, record in enumerate(trace):
        for rid, table in record.block_tables.items():
            for block_id in set(table):  # a block listed twice by one request is not shared
                if not 0 <= block_id < num_blocks:
                    raise ValueError(f"step {record.step}: request {rid!r} holds block_id {block_id}, "
                                     f"outside [0, num_blocks={num_blocks})")
                owners[i, block_id] = index[rid] if owners[i, block_id] == FREE else SHARED
    return owners, request_ids


def kv_block_map(trace: list[StepRecord], num_blocks: int, ax=None, max_steps: int | None = None,
                 title: str | None = None, legend: bool | None = None):
    """Draw the KV block map: x = step, y = block id (block 0 on top), each cell coloured by the
    request whose block_table holds that block in that step (:func:`request_colors`); white =
    free. A block held by several requests at once (shared by prefix caching, or before a
    copy-on-write) is drawn dark grey and cross-hatched ("xxxx"), whoever shares it.

    max_steps: draw only the first ``max_steps`` records. legend: one entry per request (and
    "shared" if any); default: only when there are at most MAX_LEGEND_REQUESTS requests.
    Cells with the same owner in consecutive steps are drawn as one rectangle. Two
    PolyCollections: gid "owned" (one facecolour per rectangle) and gid "shared".
    Returns the Axes; its x limits are (first step, last step + 1), y limits (num_blocks, 0).

    Raises:
        ValueError: see :func:`block_map_array`; max_steps < 1.
    """
    if max_steps is not None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        trace = trace[:max_steps]
    owners, request_ids = block_map_array(trace, num_blocks)
    colors = request_colors(request_ids)
    steps = np.array([r.step for r in trace], dtype=np.int64)  # (num_steps,)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(14, 4 + 0.1 * len(trace)), min(9, 1.5 + 0.18 * num_blocks)),
                             layout="constrained")
    owned_verts, owned_colors, shared_verts = [], [], []
    for block_id in range(num_blocks):
        for a, b in _runs(owners[:, block_id], steps):  # records a..b-1: one owner, consecutive steps
            owner = owners[a, block_id]
            verts = [(steps[a], block_id), (steps[b - 1] + 1, block_id),
                     (steps[b - 1] + 1, block_id + 1), (steps[a], block_id + 1)]
            if owner == SHARED:
                shared_verts.append(verts)
            elif owner != FREE:
                owned_verts.append(verts)
                owned_colors.append(colors[request_ids[owner]])
    if owned_verts:
        ax.add_collection(PolyCollection(owned_verts, facecolors=owned_colors, edgecolors="white",
                                         linewidths=0.3, gid="owned"))
    if shared_verts:
        ax.add_collection(PolyCollection(shared_verts, facecolors=SHARED_COLOR, edgecolors="white",
                                         linewidths=0.3, hatch=SHARED_HATCH, gid="shared"))
    ax.set_xlim(steps[0] if len(steps) else 0, steps[-1] + 1 if len(steps) else 1)
    ax.set_ylim(num_blocks, 0)  # block 0 on top, like a memory address map
    ax.set_xlabel("step")
    ax.set_ylabel("KV block id")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    if legend is None:
        legend = 0 < len(request_ids) <= MAX_LEGEND_REQUESTS
    if legend:
        handles = [Patch(facecolor=colors[rid], label=rid) for rid in request_ids]
        if shared_verts:
            handles.append(Patch(facecolor=SHARED_COLOR, hatch=SHARED_HATCH, edgecolor="white", label="shared"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def _runs(column: np.ndarray, steps: np.ndarray) -> list[tuple[int, int]]:
    """Split record indices 0..len(column) into runs [a, b): equal values, consecutive steps."""
    if len(column) == 0:
        return []
    breaks = np.flatnonzero((column[1:] != column[:-1]) | (steps[1:] != steps[:-1] + 1)) + 1
    bounds = [0, *breaks.tolist(), len(column)]
    return list(zip(bounds[:-1], bounds[1:]))
