"""Teaching allocators: the contiguous KV allocator a paged cache replaces, and the smallest paged one.

vLLM (Kwon et al., SOSP'23, §3 "Memory Challenges in LLM Serving", §3.1) names three wastes of a server that
stores each request's KV cache in one contiguous chunk of memory:

* reservation: the chunk is sized for prompt + max_new_tokens up front, so slots for tokens not
  generated yet (maybe never) are held from the first step;
* internal fragmentation: the slots reserved past the request's real end are never used;
* external fragmentation: after requests of different sizes finish in a different order than
  they arrived, free memory is split into holes; a request can be refused while the holes
  together would hold it.

:class:`ContiguousAllocator` is that naive server's memory: first-fit over a sorted list of
free extents. :meth:`ContiguousAllocator.compact` is the classic cure (slide every region left)
and shows its price: every moved token slot is one K and one V vector copied per layer.
:class:`PagedAllocator` is the smallest paged alternative (fixed-size blocks from a free list,
any block anywhere; vLLM §4.2): it refuses only when too few blocks are free, and wastes at most
block_size - 1 slots per request. ``minibatch.lessons.contiguous`` replays one event sequence on
both for notebook 04.

Units: "slot" = the KV of one token (one K and one V vector in every layer); sizes and
positions are in slots unless a name says blocks or bytes. Pure Python; the engine's allocator
is ``minibatch.kv.block_manager``, deliberately not used here.
"""

from __future__ import annotations

import bisect
from collections import deque

from minibatch.checks import check_int

FREE_LABEL = "."  # free slot in render()
LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


class FragmentationError(RuntimeError):
    """Enough slots are free in total, but no single free extent is long enough: external
    fragmentation (vLLM §3.1). compact() would make room; a paged cache would not need it."""


class OutOfSlotsError(RuntimeError):
    """Fewer slots are free in total than asked: true out-of-memory; compaction cannot help."""


def _check_request_id(request_id) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")


def check_num_slots(num_slots, name: str = "num_slots") -> None:
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"{name} must be an int >= 1, got {num_slots!r}")


class ContiguousAllocator:
    """One contiguous region of KV token slots per request, first-fit (a pre-vLLM server).

    State: ``free_extents``, a list of (start, length) sorted by start, never two touching
    (free() merges neighbours); ``regions``, request_id -> (start, length), in allocation order.

        slot 0       8   12        22     29
             ........EEEE..........DDDDDDD...    render() after the demo's "-C" ("." = free)
             free_extents = [(0, 8), (12, 10), (29, 3)]: 21 slots free, yet 12 do not fit

    Raises:
        ValueError: num_slots not an int >= 1.
    """

    def __init__(self, num_slots: int):
        check_num_slots(num_slots)
        self.num_slots = num_slots
        self.free_extents: list[tuple[int, int]] = [(0, num_slots)]
        self.regions: dict[str, tuple[int, int]] = {}
        self._labels: dict[str, str] = {}  # request_id -> one character for render()

    # ------------------------------------------------------------------ derived values
    @property
    def num_free_slots(self) -> int:
        return sum(length for _, length in self.free_extents)

    @property
    def num_allocated_slots(self) -> int:
        return sum(length for _, length in self.regions.values())

    @property
    def largest_free_extent(self) -> int:
        """Length (slots) of the longest free extent: the largest request that fits now."""
        return max((length for _, length in self.free_extents), default=0)

    @property
    def external_fragmentation(self) -> float:
        """1 - largest_free_extent / num_free_slots: 0 when free memory is one extent (or none
        is free), near 1 when it is scattered in many small holes."""
        free = self.num_free_slots
        return 0.0 if free == 0 else 1.0 - self.largest_free_extent / free

    # ------------------------------------------------------------------ allocate / free
    def allocate(self, request_id: str, num_slots: int) -> int:
        """Reserve ``num_slots`` consecutive slots for ``request_id`` in the first free extent
        long enough (lowest address); returns the region's first slot.

        A naive server asks for prompt + max_new_tokens here (Orca §4.2 reserves the same).

        Raises:
            ValueError: request_id empty/not a str or already allocated; num_slots not an int >= 1.
            FragmentationError: num_free_slots >= num_slots but no single extent fits.
            OutOfSlotsError: num_free_slots < num_slots.
        """
        _check_request_id(request_id)
        check_num_slots(num_slots)
        if request_id in self.regions:
            raise ValueError(f"request_id {request_id!r} already holds a region {self.regions[request_id]}")
        for i, (start, length) in enumerate(self.free_extents):
            if length >= num_slots:  # first fit: carve the region from the extent's left end
                if length == num_slots:
                    del self.free_extents[i]
                else:
                    self.free_extents[i] = (start + num_slots, length - num_slots)
                self.regions[request_id] = (start, num_slots)
                self._labels.setdefault(request_id, LABELS[len(self._labels) % len(LABELS)])
                return start
        free = self.num_free_slots
        if free >= num_slots:
            raise FragmentationError(
                f"request {request_id!r} needs {num_slots} contiguous KV slots: {free} are free, but "
                f"in {len(self.free_extents)} extents, the largest {self.largest_free_extent} long "
                f"(external fragmentation {self.external_fragmentation:.0%}); compact() would make room")
        raise OutOfSlotsError(f"request {request_id!r} needs {num_slots} KV slots, only {free} of "
                              f"{self.num_slots} are free (out of memory)")

    def free(self, request_id: str) -> tuple[int, int]:
        """Return ``request_id``'s region to the free list, merged with a free neighbour on
        either side; returns the freed (start, length).

        Raises:
            KeyError: request_id holds no region.
        """
        if request_id not in self.regions:
            raise KeyError(f"request_id {request_id!r} holds no region")
        start, length = self.regions.pop(request_id)
        i = bisect.bisect_left(self.free_extents, (start, length))  # where the new extent goes
        # merge with the left neighbour   [left....][freed]   -> one extent
        if i > 0 and sum(self.free_extents[i - 1]) == start:
            i -= 1
            start, length = self.free_extents[i][0], self.free_extents[i][1] + length
            del self.free_extents[i]
        # merge with the right neighbour  [freed][right....]  -> one extent
        if i < len(self.free_extents) and self.free_extents[i][0] == start + length:
            length += self.free_extents[i][1]
            del self.free_extents[i]
        self.free_extents.insert(i, (start, length))
        return start, length

    # ------------------------------------------------------------------ compaction
    def compact(self, kv=None) -> int:
        """Slide every region to the left, in address order, so that free memory becomes one
        extent at the end (compaction). Returns the number of token
        slots moved: the total length of the regions whose start changed.

            before:  [A A A][. .][E E][. . .][D D D D][.]
            after:   [A A A][E E][D D D D][. . . . . .]     slots moved = 2 + 4 = 6

        Each moved slot is one K and one V vector copied in every layer
        (:func:`compaction_bytes`); running requests must wait for the copy, which is why
        vLLM avoids contiguity instead (§4.2).

        kv: optional storage indexed by slot on axis 0 (a list, a numpy array or a torch
        tensor of shape (num_slots, ...)); each moved region's contents are copied in it, as a
        real server would have to copy its KV tensors. Ownership and order are kept.
        """
        next_start = 0
        num_slots_moved = 0
        for request_id, (start, length) in sorted(self.regions.items(), key=lambda item: item[1][0]):
            if start != next_start:  # slides left by start - next_start; src and dst may overlap
                if kv is not None:
                    chunk = kv[start:start + length]
                    kv[next_start:next_start + length] = chunk.clone() if hasattr(chunk, "clone") else chunk
                self.regions[request_id] = (next_start, length)
                num_slots_moved += length
            next_start += length
        self.free_extents = [(next_start, self.num_slots - next_start)] if next_start < self.num_slots else []
        return num_slots_moved

    # ------------------------------------------------------------------ views
    def slot_map(self) -> list[str | None]:
        """Owner request_id of every slot (None = free); length num_slots."""
        owners: list[str | None] = [None] * self.num_slots
        for request_id, (start, length) in self.regions.items():
            owners[start:start + length] = [request_id] * length
        return owners

    def render(self) -> str:
        """The slot map as text, one character per slot: "." free, else the request's label
        (A, B, C, ... in order of first allocation; see ``labels``)."""
        return "".join(FREE_LABEL if rid is None else self._labels[rid] for rid in self.slot_map())

    @property
    def labels(self) -> dict[str, str]:
        """request_id -> its character in render()."""
        return dict(self._labels)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 4) -> int:
    """Bytes of KV cache per token slot: 2 (K and V) * num_layers * num_kv_heads * head_dim *
    dtype_bytes. smollm2-135m in fp32: 2 * 30 * 3 * 64 * 4 = 46,080 B (45 KiB). A loaded
    model's ``ModelRunner.kv_bytes_per_token`` gives the same from its config and dtype. Raises ValueError: a
    size below 1."""
    for value, name in ((num_layers, "num_layers"), (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim"),
                        (dtype_bytes, "dtype_bytes")):
        check_int(value, name, 1)
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


SMOLLM2_135M_KV_BYTES_PER_TOKEN = kv_bytes_per_token(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4)


def compaction_bytes(num_slots_moved: int, kv_bytes_per_token: int) -> int:
    """Bytes compaction copies: every moved slot's K and V in every layer (reads as much again)."""
    if num_slots_moved < 0:
        raise ValueError(f"num_slots_moved must be >= 0, got {num_slots_moved}")
    if kv_bytes_per_token < 1:
        raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
    return num_slots_moved * kv_bytes_per_token


class PagedAllocator:
    """The paged alternative in miniature (vLLM §4.2): ``num_blocks`` blocks of ``block_size``
    slots; a request takes ceil(num_slots / block_size) blocks from the free list, any blocks,
    anywhere; freed blocks go to the back of the list. No prefix sharing, no on-demand growth
    (the engine's minibatch.kv does those); this one only shows that placement never fails
    while enough blocks are free, and costs at most block_size - 1 slots per request.

    Raises:
        ValueError: num_blocks or block_size not an int >= 1.
    """

    def __init__(self, num_blocks: int, block_size: int):
        check_num_slots(num_blocks, "num_blocks")
        check_num_slots(block_size, "block_size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}  # request_id -> slots it asked for

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def internal_fragmentation_slots(self) -> int:
        """Slots held but never asked for: the unused tail of each request's last block
        (at most block_size - 1 per request)."""
        return sum(len(self.block_tables[r]) * self.block_size - n for r, n in self.num_tokens.items())

    def num_blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)  # ceil

    def allocate(self, request_id: str, num_slots: int) -> list[int]:
        """Give ``request_id`` ceil(num_slots / block_size) blocks; returns its block_table.

        Raises:
            ValueError: bad or duplicate request_id; num_slots not an int >= 1.
            OutOfSlotsError: fewer free blocks than needed.
        """
        _check_request_id(request_id)
        check_num_slots(num_slots)
        if request_id in self.block_tables:
            raise ValueError(f"request_id {request_id!r} already holds blocks {self.block_tables[request_id]}")
        num_blocks = self.num_blocks_for(num_slots)
        if num_blocks > self.num_free_blocks:
            raise OutOfSlotsError(f"request {request_id!r} needs {num_blocks} KV blocks, "
                                  f"only {self.num_free_blocks} are free (out of memory)")
        self.block_tables[request_id] = [self.free_block_ids.popleft() for _ in range(num_blocks)]
        self.num_tokens[request_id] = num_slots
        return list(self.block_tables[request_id])

    def free(self, request_id: str) -> list[int]:
        """Return ``request_id``'s blocks to the back of the free list; returns them.

        Raises:
            KeyError: request_id holds no blocks.
        """
        if request_id not in self.block_tables:
            raise KeyError(f"request_id {request_id!r} holds no blocks")
        del self.num_tokens[request_id]
        block_table = self.block_tables.pop(request_id)
        self.free_block_ids.extend(block_table)
        return block_table

    def block_map(self) -> list[str | None]:
        """Owner request_id of every block (None = free); length num_blocks."""
        owners: list[str | None] = [None] * self.num_blocks
        for request_id, table in self.block_tables.items():
            for block_id in table:
                owners[block_id] = request_id
        return owners

    def block_fill(self) -> list[int]:
        """Slots in use in every block: block_size for full blocks, fewer in a request's last
        block, 0 for free blocks; length num_blocks."""
        fill = [0] * self.num_blocks
        for request_id, table in self.block_tables.items():
            for i, block_id in enumerate(table):  # logical block i holds positions i*bs .. i*bs+bs-1
                fill[block_id] = min(self.block_size, self.num_tokens[request_id] - i * self.block_size)
        return fill
