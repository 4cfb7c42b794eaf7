"""Notebook 04's contrast lesson: one event sequence replayed on the contiguous allocator a paged
KV cache replaces and on a paged one (``minibatch.kv.contiguous``), printed and drawn.

vLLM (Kwon et al., SOSP'23, §3.1): reservation, internal and external fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from minibatch.kv.contiguous import (FREE_LABEL, LABELS, SMOLLM2_135M_KV_BYTES_PER_TOKEN,  # noqa: F401 (for notebook 04)
                                     ContiguousAllocator, FragmentationError, OutOfSlotsError, PagedAllocator,
                                     check_num_slots, compaction_bytes)


# ---------------------------------------------------------------------- the demo
class Event(NamedTuple):
    """One demo event. kind: "arrive" (reserve num_slots for request_id), "finish" (free it);
    :func:`fragmentation_demo` adds "compact" and "retry" rows of its own."""

    kind: str
    request_id: str = ""
    num_slots: int = 0

    @property
    def label(self) -> str:
        return {"arrive": f"+{self.request_id} {self.num_slots}", "finish": f"-{self.request_id}",
                "compact": "compact", "retry": f"+{self.request_id} {self.num_slots} (retry)"}[self.kind]


# Four requests fill 29 of 32 slots; they finish B, A, C (not in arrival order), E slips into
# B's hole, and F (12 slots) is refused with 21 slots free: the holes are 8, 10 and 3 long.
DEMO_EVENTS: tuple[Event, ...] = (
    Event("arrive", "A", 8), Event("arrive", "B", 6), Event("arrive", "C", 8), Event("arrive", "D", 7),
    Event("finish", "B"), Event("arrive", "E", 4), Event("finish", "A"), Event("finish", "C"),
    Event("arrive", "F", 12),
)


@dataclass
class DemoStep:
    """The state of both allocators after one demo row (slots unless the name says blocks).

    refused: the contiguous allocator's refusal of this row's request: "fragmentation",
    "out of memory", or None. start: where its region went (None: not placed).
    paged_refused: the paged allocator refused this row's request (out of blocks).
    """

    event: Event
    refused: str | None
    start: int | None
    num_slots_moved: int
    free_extents: list[tuple[int, int]]
    num_free_slots: int
    largest_free_extent: int
    external_fragmentation: float
    slot_map: list[str | None]
    paged_refused: bool
    block_table: list[int] | None
    num_free_blocks: int
    internal_fragmentation_slots: int
    block_map: list[str | None]
    block_fill: list[int]


def fragmentation_demo(events=DEMO_EVENTS, num_slots: int = 32, block_size: int = 4,
                       compact: bool = True) -> list[DemoStep]:
    """Replay ``events`` on a ContiguousAllocator(num_slots) and on a PagedAllocator with the
    same memory (num_slots // block_size blocks); one DemoStep per row.

    When an arrival is refused for fragmentation and ``compact`` is true, two rows follow:
    "compact" (num_slots_moved) and "retry" (the same request, now placed). The paged
    allocator acts on "arrive" and "finish" rows only, so it has already placed the request on
    the refused row. A request refused by an allocator is not in it; its "finish" is a no-op
    there. Deterministic: no randomness anywhere.

    Raises:
        ValueError: an unknown event kind; num_slots not a positive multiple of block_size.
    """
    check_num_slots(block_size, "block_size")
    if num_slots < block_size or num_slots % block_size:
        raise ValueError(f"num_slots ({num_slots}) must be a positive multiple of block_size ({block_size})")
    contiguous = ContiguousAllocator(num_slots)
    paged = PagedAllocator(num_slots // block_size, block_size)
    steps: list[DemoStep] = []

    def record(event: Event, refused=None, start=None, moved=0, paged_refused=False, block_table=None):
        steps.append(DemoStep(
            event, refused, start, moved, list(contiguous.free_extents), contiguous.num_free_slots,
            contiguous.largest_free_extent, contiguous.external_fragmentation, contiguous.slot_map(),
            paged_refused, block_table, paged.num_free_blocks, paged.internal_fragmentation_slots,
            paged.block_map(), paged.block_fill()))

    for event in events:
        if event.kind == "finish":
            if event.request_id in contiguous.regions:  # absent if it was refused there
                contiguous.free(event.request_id)
            if event.request_id in paged.block_tables:
                paged.free(event.request_id)
            record(event)
            continue
        if event.kind != "arrive":
            raise ValueError(f"event kind must be 'arrive' or 'finish', got {event.kind!r}")
        try:
            block_table, paged_refused = paged.allocate(event.request_id, event.num_slots), False
        except OutOfSlotsError:
            block_table, paged_refused = None, True
        try:
            record(event, start=contiguous.allocate(event.request_id, event.num_slots),
                   paged_refused=paged_refused, block_table=block_table)
        except OutOfSlotsError:
            record(event, refused="out of memory", paged_refused=paged_refused, block_table=block_table)
        except FragmentationError:
            record(event, refused="fragmentation", paged_refused=paged_refused, block_table=block_table)
            if compact:
                record(Event("compact"), moved=contiguous.compact())
                retry = Event("retry", event.request_id, event.num_slots)
                record(retry, start=contiguous.allocate(event.request_id, event.num_slots))
    return steps


def print_demo(steps: list[DemoStep]) -> None:
    """One line per demo row: event, contiguous slot map (render()-style), free extents,
    refusal or slots moved; then the paged block map (one character per block) and its
    internal fragmentation."""
    ids = list(dict.fromkeys(r for s in steps for r in s.slot_map + s.block_map if r is not None))
    # one character per request: its id if every id is one character, else A, B, C, ... in order
    labels = {r: r if all(len(i) == 1 for i in ids) else LABELS[k % len(LABELS)] for k, r in enumerate(ids)}
    show = lambda owners: "".join(FREE_LABEL if r is None else labels[r] for r in owners)  # noqa: E731
    width = len(steps[0].slot_map) if steps else 0
    print(f"{'event':<14} {'contiguous slots':<{width}}  {'free extents (start, len)':<26}{'':<24}  paged blocks")
    for s in steps:
        note = (f"REFUSED: {s.refused}" if s.refused else
                f"moved {s.num_slots_moved} slots" if s.event.kind == "compact" else "")
        extents = " ".join(f"({a},{n})" for a, n in s.free_extents)
        paged = f"{show(s.block_map)}  {'REFUSED, ' if s.paged_refused else ''}" \
                f"unused {s.internal_fragmentation_slots}"
        print(f"{s.event.label:<14} {show(s.slot_map)}  {extents:<26}{note:<24}  {paged}")


def plot_demo(steps: list[DemoStep], kv_bytes_per_token: int | None = None):
    """Left: the contiguous slot map, one row per demo row (top first), a colour per request,
    free slots white and hatched; refusals and compactions annotated. Right: the paged cache
    on the same slots, block boundaries drawn, each block's unused tail (internal
    fragmentation) in a paler shade. kv_bytes_per_token: if given, the compaction note also
    says how many bytes were copied. Returns the Figure (no plt.show())."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    from minibatch.viz.kv_map import request_colors

    ids = {r for s in steps for r in s.slot_map + s.block_map if r is not None}
    colors = request_colors(ids)
    num_slots = len(steps[0].slot_map)
    block_size = num_slots // len(steps[0].block_map)  # fragmentation_demo: same memory, whole blocks
    num_rows = len(steps)
    fig, (ax_c, ax_p) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.38 * num_rows), sharey=True,
                                     layout="constrained")
    free_style = dict(facecolor="white", edgecolor="#BBBBBB", hatch="///", linewidth=0)
    for row, s in enumerate(steps):
        for x0, width, rid in _runs_of(s.slot_map):  # contiguous: one rectangle per region / hole
            style = free_style if rid is None else dict(facecolor=colors[rid], edgecolor="white", linewidth=0.5)
            ax_c.add_patch(Rectangle((x0, row + 0.1), width, 0.8, **style))
        for block_id, (rid, fill) in enumerate(zip(s.block_map, s.block_fill)):  # paged: block by block
            x0 = block_id * block_size
            if rid is None:
                ax_p.add_patch(Rectangle((x0, row + 0.1), block_size, 0.8, **free_style))
                continue
            ax_p.add_patch(Rectangle((x0, row + 0.1), fill, 0.8, facecolor=colors[rid], linewidth=0))
            if fill < block_size:  # reserved but unused: internal fragmentation
                ax_p.add_patch(Rectangle((x0 + fill, row + 0.1), block_size - fill, 0.8,
                                         facecolor=colors[rid], alpha=0.3, linewidth=0))
        paged_note = f"{s.event.request_id} refused" if s.paged_refused else f"{s.internal_fragmentation_slots} unused"
        ax_p.text(1.01, row + 0.5, paged_note, transform=ax_p.get_yaxis_transform(), va="center",
                  fontsize=8, color="#B00000" if s.paged_refused else "#555555")
    for x in range(0, num_slots + 1, block_size):
        ax_p.axvline(x, color="#666666", linewidth=0.6)
    for ax, title in ((ax_c, "contiguous: one region per request (first fit)"),
                      (ax_p, f"paged: blocks of {block_size} slots, any block anywhere\n"
                             "(pale: reserved, unused; right: unused slots in all)")):
        ax.set_xlim(0, num_slots)
        ax.set_ylim(num_rows, 0)
        ax.set_xlabel("KV token slot")
        ax.set_title(title, loc="left", fontsize=10)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    ax_c.set_yticks([r + 0.5 for r in range(num_rows)], [_row_label(s, kv_bytes_per_token) for s in steps],
                    fontsize=8)
    for tick, s in zip(ax_c.get_yticklabels(), steps):
        tick.set_color("#B00000" if s.refused else "black")
    ax_c.tick_params(axis="y", length=0)
    handles = [Patch(facecolor=color, label=rid) for rid, color in colors.items()]
    handles.append(Patch(**free_style, label="free"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    return fig


def _row_label(s: DemoStep, kv_bytes_per_token: int | None) -> str:
    """A demo row's y label: the event, and the contiguous allocator's refusal or compaction."""
    if s.refused:
        return f"{s.event.label}: refused, {s.refused} ({s.num_free_slots} free, largest {s.largest_free_extent})"
    if s.event.kind == "compact":
        moved = f"compact: {s.num_slots_moved} slots moved"
        if kv_bytes_per_token:
            moved += f" = {compaction_bytes(s.num_slots_moved, kv_bytes_per_token) / 2**20:.2f} MiB"
        return moved
    return s.event.label


def _runs_of(owners: list[str | None]) -> list[tuple[int, int, str | None]]:
    """(start, length, owner) of each run of equal owners."""
    runs: list[tuple[int, int, str | None]] = []
    for i, rid in enumerate(owners):
        if runs and runs[-1][2] == rid:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, rid)
        else:
            runs.append((i, 1, rid))
    return runs
