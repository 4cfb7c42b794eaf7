"""A free list of KV blocks.

The KV tensors hold ``num_blocks`` blocks of ``block_size`` token slots each. A request owns a
``block_table`` (its block ids); token position ``pos`` lives in slot

    block_table[pos // block_size] * block_size + pos % block_size      (the slot_mapping)

This issue's Orca scheduler reserves all blocks a request can ever need at admission (with
block_size = 1 that is exactly Orca's per-token reservation). The paged KV issue adds ref_cnt,
prefix caching and on-demand allocation on top.
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Hands out block ids from a free list.

    Raises:
        ValueError: num_blocks or block_size < 1.
        RuntimeError: allocate() with too few free blocks (callers check ``num_free_blocks``).
    """

    def __init__(self, num_blocks: int, block_size: int = 1):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} KV blocks, {self.num_free_blocks} free")
        return [self.free_block_ids.popleft() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        self.free_block_ids.extend(block_ids)
