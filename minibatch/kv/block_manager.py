"""The paged KV block manager: block tables, ref_cnt, prefix caching, copy-on-write, swap.

vLLM (Kwon et al., "Efficient Memory Management for LLM Serving with PagedAttention", SOSP'23):
the KV cache is cut into fixed-size blocks of ``block_size`` token slots (§4.1); a request's
``block_table`` lists its blocks in position order, so token position ``pos`` lives in slot

    block_table[pos // block_size] * block_size + pos % block_size      (the slot_mapping)

and blocks need not be contiguous. Everything here is bookkeeping on integers; the runner moves
the bytes (copies and swaps are returned as (src, dst) block-id pairs).

* **On-demand allocation** (§4.2): a request gets a new block only when its last one is full,
  so at most ``block_size - 1`` slots per request are ever empty (internal fragmentation).
* **ref_cnt and copy-on-write** (§4.4, parallel sampling): ``fork`` lets a child request share
  its parent's prompt blocks (ref_cnt + 1 each); the first write into a shared block copies it
  to a fresh block (``allocate_slots`` returns the copy to make).
* **Prefix caching** (§4.4 shared prefix; vLLM's automatic prefix caching): every *full* block
  gets a hash chained over the whole prefix, ``hash((parent_hash, token_ids))``; a new request
  looks its prompt blocks up by hash (and checks the token ids, so a hash collision can never
  serve wrong KV). Freed blocks keep their hash and content: they sit in the free list, oldest
  first, and are evicted (their hash forgotten) only when handed out again (lazy LRU).
* **Swap** (§4.5): a preempted request's blocks are copied to a pool of CPU blocks and back.

Invariant (tested with hypothesis): for every block, ``ref_cnt`` equals the number of block
tables holding it; a block is in the free list exactly when its ref_cnt is 0.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from minibatch.checks import check_int, check_real


@dataclass
class KVBlock:
    """One block of ``block_size`` KV slots. block_hash/token_ids are set once the block is full
    and registered in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: it depends on every token before it, through the
    parent's hash, so equal hashes mean equal prefixes (up to collisions, which the token check
    on a hit catches)."""
    return hash((parent_hash, token_ids))


class BlockManager:
    """Block tables over ``num_blocks`` GPU blocks (and ``num_cpu_blocks`` for swapping).

    Args:
        num_blocks: KV blocks in the cache, >= 1.
        block_size: token slots per block, >= 1 (vLLM's default is 16).
        enable_prefix_caching: share full prompt blocks between requests by hash.
        watermark: fraction of blocks admission keeps free (``int(watermark * num_blocks)`` blocks), so
            that running requests can still grow a block without preempting at once; 0 <= watermark < 1.
            The default here is 0.0 (none kept); ``PagedScheduler`` passes 0.01 by default (its config's
            ``watermark``), the value of vLLM v0's ``BlockSpaceManager``.
        num_cpu_blocks: CPU blocks for swap-out preemption, >= 0.

    Raises:
        ValueError: an argument out of range (FieldTypeError for a wrong type; the message names it).
        KeyError: an operation on a request that holds no blocks.
        RuntimeError: an operation that needs more free blocks than there are (callers check
            ``can_*`` first; the scheduler preempts instead).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, enable_prefix_caching: bool = False,
                 watermark: float = 0.0, num_cpu_blocks: int = 0):
        check_int(num_blocks, "num_blocks", 1)
        check_int(block_size, "block_size", 1)
        check_real(watermark, "watermark", 0.0, 1.0, high_open=True)
        check_int(num_cpu_blocks, "num_cpu_blocks", 0)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        # Bookkeeping grows with the blocks used, not with num_blocks (a huge cache costs nothing
        # until it fills): a KVBlock exists once its block was handed out, and the ids never
        # handed out yet are the range [_next_fresh, num_blocks).
        self.blocks: dict[int, KVBlock] = {}
        self._next_fresh = 0
        # released blocks, eviction order first: uncached ones at the front (reused before the
        # never-used ids), cached ones at the back (least recently used first); an OrderedDict so
        # a cache hit can take one out in O(1). Free = released + never used.
        self.free_blocks: OrderedDict[int, None] = OrderedDict()
        self.cached_blocks: dict[int, int] = {}  # block_hash -> block_id (full blocks, in use or free)
        self.block_tables: dict[str, list[int]] = {}  # request_id -> GPU block ids, position order
        self.num_hashed_blocks: dict[str, int] = {}  # request_id -> leading blocks already hashed
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks: list[int] = []  # CPU blocks given back (a stack); never-used ids come after
        self._next_fresh_cpu = 0
        self.cpu_block_tables: dict[str, list[int]] = {}  # swapped-out request_id -> CPU block ids
        # prefix cache stats (vLLM's PrefixCacheStats: queries and hits, in tokens)
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    # ------------------------------------------------------------------ sizes
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached ones included: they are evicted on demand)."""
        return len(self.free_blocks) + self.num_blocks - self._next_fresh

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.free_cpu_blocks) + self.num_cpu_blocks - self._next_fresh_cpu

    def is_free(self, block_id: int) -> bool:
        """Whether the GPU block has ref_cnt 0 (never used, or released)."""
        return block_id >= self._next_fresh or block_id in self.free_blocks

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    # ------------------------------------------------------------------ single blocks
    def _take_free_block(self) -> int:
        """The next block in eviction order: a released uncached block, else a never-used one,
        else the least recently used cached block (its cache entry is evicted)."""
        if self.free_blocks and (self._next_fresh == self.num_blocks
                                 or self.blocks[next(iter(self.free_blocks))].block_hash is None):
            block_id, _ = self.free_blocks.popitem(last=False)
        elif self._next_fresh < self.num_blocks:
            block_id, self._next_fresh = self._next_fresh, self._next_fresh + 1
            self.blocks[block_id] = KVBlock(block_id)
        else:
            raise RuntimeError("no free KV block")
        block = self.blocks[block_id]
        if block.block_hash is not None:  # lazy eviction: its cached content is overwritten now
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = block.token_ids = None
        block.ref_cnt = 1
        return block_id

    def _share(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:  # a cache hit on a freed block revives it
            del self.free_blocks[block_id]
        block.ref_cnt += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt < 1:
            raise RuntimeError(f"block {block_id} freed twice")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_blocks[block_id] = None
            if block.block_hash is None:  # nothing worth keeping: reuse it first
                self.free_blocks.move_to_end(block_id, last=False)

    # ------------------------------------------------------------------ prefix caching
    def get_computed_blocks(self, request) -> list[int]:
        """Prompt blocks of ``request`` already in the cache (prefix caching), in order.

        Only full blocks within the first ``num_tokens - 1`` tokens count: the last token is
        always computed again, because sampling needs its logits (vLLM does the same).
        Returns [] when prefix caching is off. The caller reports admitted requests' hits with
        ``record_prefix_hits`` (a lookup that does not lead to admission is not counted).
        """
        if not self.enable_prefix_caching:
            return []
        token_ids = request.all_token_ids
        hits: list[int] = []
        parent = None
        for i in range((len(token_ids) - 1) // self.block_size):
            chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = hash_block(parent, chunk)
            block_id = self.cached_blocks.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:  # miss or collision
                break
            hits.append(block_id)
        return hits

    def record_prefix_hits(self, request, hits: list[int]) -> None:
        """Count one admitted request's lookup for ``prefix_cache_hit_rate``."""
        if self.enable_prefix_caching:
            self.num_prefix_query_tokens += request.num_tokens
            self.num_prefix_hit_tokens += len(hits) * self.block_size

    def cache_full_blocks(self, request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache (no-op when off)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self.block_tables[rid]
        token_ids = request.all_token_ids
        done = self.num_hashed_blocks.get(rid, 0)
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        parent = self.blocks[table[done - 1]].block_hash if done else None
        for i in range(done, num_full):
            block = self.blocks[table[i]]
            chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            if block.block_hash is None:
                block.block_hash, block.token_ids = hash_block(parent, chunk), chunk
                self.cached_blocks.setdefault(block.block_hash, block.block_id)  # first copy wins
            parent = block.block_hash
        self.num_hashed_blocks[rid] = max(done, num_full)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (their KV may have been overwritten: the cache tensor
        was handed to another engine). Blocks in use keep their place; call it with none held."""
        for block_id in self.cached_blocks.values():
            self.blocks[block_id].block_hash = self.blocks[block_id].token_ids = None
        self.cached_blocks.clear()
        self.num_hashed_blocks = {rid: 0 for rid in self.num_hashed_blocks}

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried prompt tokens (0 before any query)."""
        q = self.num_prefix_query_tokens
        return self.num_prefix_hit_tokens / q if q else 0.0

    # ------------------------------------------------------------------ request-level operations
    def _cow_block(self, request, num_new_tokens: int) -> int | None:
        """Index in the block table of a shared block the request's next write lands in (it must
        be copied first: copy-on-write), or None."""
        table = self.block_tables.get(request.request_id)
        j = request.num_computed_tokens // self.block_size
        if num_new_tokens and table and j < len(table) and self.blocks[table[j]].ref_cnt > 1:
            return j
        return None

    def num_blocks_needed(self, request, num_new_tokens: int, computed_blocks: list[int] = ()) -> int:
        """Free blocks it takes to give ``request`` room for ``num_new_tokens`` more tokens: new
        blocks, a copy-on-write copy of a shared block it writes into, and prefix-cache hits that
        sit in the free list (reviving them uses up free blocks too)."""
        table = self.block_tables.get(request.request_id)
        if table is None:
            table = list(computed_blocks)
            revived = sum(self.blocks[b].ref_cnt == 0 for b in computed_blocks)
        else:
            revived = 0
        num_tokens = request.num_computed_tokens + num_new_tokens
        cow = self._cow_block(request, num_new_tokens) is not None
        return max(0, self.num_blocks_for(num_tokens) - len(table)) + revived + cow

    def can_allocate(self, request, num_new_tokens: int, computed_blocks: list[int] = (),
                     use_watermark: bool = False) -> bool:
        """Whether ``allocate_slots`` would succeed. Admission (use_watermark=True) leaves
        ``watermark_blocks`` free for running requests to grow into."""
        free = self.num_free_blocks - (self.watermark_blocks if use_watermark else 0)
        return self.num_blocks_needed(request, num_new_tokens, computed_blocks) <= free

    def allocate_slots(self, request, num_new_tokens: int, computed_blocks: list[int] = (),
                       use_watermark: bool = False) -> list[tuple[int, int]] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``: its KV for positions
        num_computed_tokens .. num_computed_tokens + num_new_tokens - 1.

        A new request passes its prefix-cache hits as ``computed_blocks`` (its num_computed_tokens
        must already equal len(computed_blocks) * block_size). Returns the copy-on-write copies
        the runner must make before the forward, as (src_block, dst_block) pairs, or None (and
        changes nothing) if there are not enough free blocks.

        Raises:
            ValueError: a request without blocks yet whose num_computed_tokens is not
                len(computed_blocks) x block_size.
        """
        if not self.can_allocate(request, num_new_tokens, computed_blocks, use_watermark):
            return None
        rid = request.request_id
        if rid not in self.block_tables:
            if request.num_computed_tokens != len(computed_blocks) * self.block_size:
                raise ValueError(f"request {rid!r}: num_computed_tokens {request.num_computed_tokens} "
                                 f"!= {len(computed_blocks)} cached blocks x block_size {self.block_size}")
            for b in computed_blocks:
                self._share(b)
            self.block_tables[rid] = list(computed_blocks)
            self.num_hashed_blocks[rid] = len(computed_blocks)
        table = self.block_tables[rid]
        copies = []
        j = self._cow_block(request, num_new_tokens)
        if j is not None:  # first write into a shared block: write into a private copy instead
            new = self._take_free_block()
            copies.append((table[j], new))
            self._release(table[j])
            table[j] = new
        while len(table) < self.num_blocks_for(request.num_computed_tokens + num_new_tokens):
            table.append(self._take_free_block())
        return copies

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Keep only the blocks the first ``num_tokens`` tokens need; release the rest (speculative
        decoding's rollback: blocks that held only rejected draft tokens). Returns blocks released."""
        table = self.block_tables[request_id]
        keep = self.num_blocks_for(num_tokens)
        released = table[keep:]
        for b in released:
            self._release(b)
        del table[keep:]
        return len(released)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Share the blocks holding the parent's first ``num_tokens`` tokens with a new child
        (parallel sampling, vLLM §4.4): ref_cnt + 1 each, the partly filled last block too, nothing copied until
        one of them writes into a shared block (copy-on-write in :meth:`allocate_slots`).

        Raises:
            ValueError: the child already holds blocks.
            KeyError: the parent holds none."""
        if child_id in self.block_tables:
            raise ValueError(f"request {child_id!r} already holds blocks")
        shared = self.block_tables[parent_id][: self.num_blocks_for(num_tokens)]
        for b in shared:
            self._share(b)
        self.block_tables[child_id] = list(shared)
        self.num_hashed_blocks[child_id] = 0

    def free(self, request_id: str) -> None:
        """Release every block of the request (finish or recompute preemption); blocks whose
        ref_cnt drops to 0 return to the free list (keeping their prefix-cache hash)."""
        for b in reversed(self.block_tables.pop(request_id)):  # tail first: evicted first
            self._release(b)
        self.num_hashed_blocks.pop(request_id, None)

    def free_any(self, request_id: str) -> None:
        """Release whatever the request holds: its GPU blocks, or its CPU blocks if it is
        swapped out; nothing if it holds none (an aborted waiting request)."""
        if request_id in self.block_tables:
            self.free(request_id)
        if request_id in self.cpu_block_tables:
            self.free_cpu_blocks.extend(reversed(self.cpu_block_tables.pop(request_id)))

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, request_id: str) -> bool:
        return len(self.block_tables[request_id]) <= self.num_free_cpu_blocks

    def _take_cpu_block(self) -> int:
        if self.free_cpu_blocks:
            return self.free_cpu_blocks.pop()
        self._next_fresh_cpu += 1
        return self._next_fresh_cpu - 1

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move a request's blocks to CPU blocks. Returns (gpu_block, cpu_block) copies to make
        before the GPU blocks are reused (the runner does them first thing in the step)."""
        if not self.can_swap_out(request_id):
            raise RuntimeError(f"swap_out {request_id!r}: {self.num_free_cpu_blocks} free CPU blocks")
        gpu = self.block_tables[request_id]
        cpu = [self._take_cpu_block() for _ in gpu]
        self.free(request_id)
        self.cpu_block_tables[request_id] = cpu
        return list(zip(gpu, cpu))

    def can_swap_in(self, request, use_watermark: bool = True, num_new_tokens: int | None = None) -> bool:
        """Whether a swapped-out request fits back with room for ``num_new_tokens`` more tokens
        (default: all its tokens, the one sampled but not yet computed included; a decode with k
        draft tokens needs 1 + k)."""
        free = self.num_free_blocks - (self.watermark_blocks if use_watermark else 0)
        n = request.num_tokens - request.num_computed_tokens if num_new_tokens is None else num_new_tokens
        return self.num_blocks_for(request.num_computed_tokens + n) <= free

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Bring a swapped-out request back into fresh GPU blocks; returns (cpu_block, gpu_block)
        copies. Its blocks are re-hashed for the prefix cache as it computes further."""
        if len(self.cpu_block_tables[request_id]) > self.num_free_blocks:
            raise RuntimeError(f"swap_in {request_id!r}: {self.num_free_blocks} free GPU blocks")
        cpu = self.cpu_block_tables.pop(request_id)
        gpu = [self._take_free_block() for _ in cpu]
        self.free_cpu_blocks.extend(reversed(cpu))
        self.block_tables[request_id] = gpu
        self.num_hashed_blocks[request_id] = 0
        return list(zip(cpu, gpu))

    # ------------------------------------------------------------------ accounting
    def num_slots_used(self, requests) -> int:
        """Physical slots holding computed KV of ``requests`` (a shared block counts once)."""
        tables = [(r.num_computed_tokens, self.block_tables.get(r.request_id, ())) for r in requests]
        blocks = [b for _, table in tables for b in table]
        if len(set(blocks)) == len(blocks):  # no block shared (every step's record asks: this is the common case)
            return sum(min(computed, len(table) * self.block_size) for computed, table in tables if computed > 0)
        fill: dict[int, int] = {}
        for computed, table in tables:
            for j, b in enumerate(table):
                n = min(self.block_size, computed - j * self.block_size)
                if n > 0:
                    fill[b] = max(fill.get(b, 0), n)
        return sum(fill.values())

    def check_invariants(self) -> None:
        """Raise AssertionError if ref_cnt, the free list or the cache index disagree (tests)."""
        holders: dict[int, int] = {}
        for table in self.block_tables.values():
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        assert all(b < self._next_fresh for b in holders), "a never-used block is held"
        for block in self.blocks.values():
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders.get(block.block_id, 0)} tables")
            assert (block.ref_cnt == 0) == self.is_free(block.block_id), f"block {block.block_id} free-list mismatch"
        assert len(self.blocks) == self._next_fresh, "a used block has no KVBlock"
        for h, b in self.cached_blocks.items():
            assert self.blocks[b].block_hash == h, f"cache index points at block {b} with another hash"
        cpu_held = [b for t in self.cpu_block_tables.values() for b in t]
        assert len(cpu_held) == len(set(cpu_held)), "a CPU block is held twice"
        assert len(cpu_held) + self.num_free_cpu_blocks == self.num_cpu_blocks, "CPU blocks leaked"
