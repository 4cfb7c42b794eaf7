"""The fragmentation demo of notebook 04: one event sequence (arrivals and finishes) replayed on the
contiguous allocator a paged KV cache replaces and on a paged one (``minibatch.kv.contiguous``),
one :class:`DemoStep` per row. vLLM (Kwon et al., SOSP'23, §3.1): reservation, internal and external
fragmentation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from minibatch.kv.contiguous import (ContiguousAllocator, FragmentationError, OutOfSlotsError, PagedAllocator,
                                     check_num_slots)


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
