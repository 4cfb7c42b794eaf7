"""The paged KV block manager: hand-checked cases, then a hypothesis state machine that runs
random allocate / append / fork / free / preempt (recompute and swap) / prefix-hit sequences
against a shadow KV cache holding token ids, so every read of every request is checked."""

from dataclasses import dataclass, field

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minibatch.kv import BlockManager


@dataclass
class Req:
    """The part of a Request the block manager reads."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    children: list = field(default_factory=list)

    @property
    def num_tokens(self):
        return len(self.all_token_ids)


def test_on_demand_allocation_and_free():
    bm = BlockManager(8, block_size=4)
    r = Req("a", list(range(5)))
    assert bm.allocate_slots(r, 5) == []
    assert len(bm.block_tables["a"]) == 2 and bm.num_free_blocks == 6
    r.num_computed_tokens = 5
    r.all_token_ids.append(9)
    bm.allocate_slots(r, 1)  # position 5 still fits in block 1
    assert len(bm.block_tables["a"]) == 2
    r.num_computed_tokens = 8
    r.all_token_ids += [1, 2, 3]
    bm.allocate_slots(r, 1)  # position 8: a third block, only now
    assert len(bm.block_tables["a"]) == 3
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocation_refuses_without_change_when_full():
    bm = BlockManager(2, block_size=4)
    r = Req("a", list(range(9)))
    assert bm.allocate_slots(r, 9) is None
    assert bm.num_free_blocks == 2 and "a" not in bm.block_tables


def test_watermark_applies_to_admission_only():
    bm = BlockManager(100, block_size=1, watermark=0.1)  # 10 blocks kept back
    assert not bm.can_allocate(Req("a", [0] * 91), 91, use_watermark=True)
    assert bm.can_allocate(Req("a", [0] * 91), 91, use_watermark=False)


def test_prefix_cache_hit_chain_and_last_token_recomputed():
    bm = BlockManager(16, block_size=4, enable_prefix_caching=True)
    a = Req("a", list(range(12)))
    bm.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    # same 12-token prompt: only 2 blocks hit, the third holds the last token, computed again
    b = Req("b", list(range(12)))
    assert bm.get_computed_blocks(b) == bm.block_tables["a"][:2]
    # a different first block breaks the chain even if later blocks are equal
    c = Req("c", [99] + list(range(1, 12)))
    assert bm.get_computed_blocks(c) == []
    # freed blocks stay cached until their slot is needed (lazy eviction)
    bm.free("a")
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    b.num_computed_tokens = 8
    assert bm.num_blocks_needed(b, 4, hits) == 3  # 1 new + 2 revived from the free list
    bm.allocate_slots(b, 4, hits)
    bm.record_prefix_hits(b, hits)
    assert bm.prefix_cache_hit_rate == 8 / 12
    bm.check_invariants()


def test_lru_eviction_takes_uncached_blocks_first():
    bm = BlockManager(4, block_size=2, enable_prefix_caching=True)
    a = Req("a", [1, 2, 3, 4])
    bm.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    bm.free("a")
    b = Req("b", [7, 7, 7, 7])
    bm.allocate_slots(b, 4)  # takes the 2 never-cached blocks
    assert len(bm.get_computed_blocks(Req("x", [1, 2, 3, 4, 5]))) == 2
    c = Req("c", [8, 8])
    bm.allocate_slots(c, 2)  # must now evict a cached block: the tail went to the free list first
    assert bm.get_computed_blocks(Req("x", [1, 2, 3, 4, 5])) == [0]
    bm.check_invariants()


def test_fork_shares_then_copies_on_first_write():
    bm = BlockManager(8, block_size=4)
    p = Req("p", list(range(6)))
    bm.allocate_slots(p, 6)
    p.num_computed_tokens = 6
    bm.fork("p", "c", 6)
    assert bm.block_tables["c"] == bm.block_tables["p"]
    assert [bm.blocks[b].ref_cnt for b in bm.block_tables["p"]] == [2, 2]
    c = Req("c", list(range(6)), num_computed_tokens=5)  # the child recomputes the last prompt token
    copies = bm.allocate_slots(c, 1)
    assert copies == [(bm.block_tables["p"][1], bm.block_tables["c"][1])]
    assert bm.block_tables["c"][0] == bm.block_tables["p"][0]  # the full block stays shared
    assert bm.blocks[bm.block_tables["p"][1]].ref_cnt == 1
    bm.check_invariants()


def test_swap_out_and_in_round_trip():
    bm = BlockManager(4, block_size=2, num_cpu_blocks=4)
    a = Req("a", [1, 2, 3])
    bm.allocate_slots(a, 3)
    gpu = list(bm.block_tables["a"])
    out = bm.swap_out("a")
    assert [g for g, _ in out] == gpu and bm.num_free_blocks == 4 and bm.num_free_cpu_blocks == 2
    back = bm.swap_in("a")
    assert [c for c, _ in back] == [c for _, c in out] and bm.num_free_cpu_blocks == 4
    bm.check_invariants()


@pytest.mark.parametrize("kwargs", [dict(num_blocks=0), dict(num_blocks=4, block_size=0),
                                    dict(num_blocks=4, watermark=1.0), dict(num_blocks=4, num_cpu_blocks=-1)])
def test_bad_arguments_name_the_field(kwargs):
    field_name = [k for k in kwargs if k != "num_blocks"] or ["num_blocks"]
    with pytest.raises(ValueError, match=field_name[-1]):
        BlockManager(**kwargs)


# ---------------------------------------------------------------------------- property tests
BLOCK_SIZE = 3
PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7, 7, 7]]  # shared prefixes give cache hits


class BlockManagerMachine(RuleBasedStateMachine):
    """Random operations on a BlockManager with a shadow KV cache: each slot holds the token id
    whose "KV" was written there. The runner's copies (COW, swap) are applied to the shadow."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BLOCK_SIZE, enable_prefix_caching=True, watermark=0.1, num_cpu_blocks=6)
        self.gpu = {b: [None] * BLOCK_SIZE for b in range(12)}
        self.cpu = {b: [None] * BLOCK_SIZE for b in range(6)}
        self.running: dict[str, Req] = {}
        self.swapped: dict[str, Req] = {}
        self.n = 0

    # --- the runner's side
    def _copy(self, pairs, src, dst):
        for s, d in pairs:
            dst[d] = list(src[s])

    def _compute(self, r: Req, copies):
        """Apply copies, then write the KV of positions num_computed_tokens .. num_tokens - 1."""
        self._copy(copies, self.gpu, self.gpu)
        if copies:
            event("copy-on-write")
        table = self.bm.block_tables[r.request_id]
        for pos in range(r.num_computed_tokens, r.num_tokens):
            block = table[pos // BLOCK_SIZE]
            assert self.bm.blocks[block].ref_cnt == 1, "a write landed in a shared block"
            self.gpu[block][pos % BLOCK_SIZE] = r.all_token_ids[pos]
        r.num_computed_tokens = r.num_tokens
        self.bm.cache_full_blocks(r)

    def _preempt_newest(self):
        rid = list(self.running)[-1]
        r = self.running.pop(rid)
        if self.bm.can_swap_out(rid) and self.n % 2:
            self._copy(self.bm.swap_out(rid), self.gpu, self.cpu)
            self.swapped[rid] = r
            event("swap out")
        else:  # recompute: forget the KV
            self.bm.free(rid)
            r.num_computed_tokens = 0

    # --- rules
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, 4), max_size=5))
    def add_request(self, prefix, tail):
        self.n += 1
        r = Req(f"r{self.n}", prefix + tail)
        hits = self.bm.get_computed_blocks(r)
        assert len(hits) * BLOCK_SIZE <= r.num_tokens - 1  # the last token is always computed
        r.num_computed_tokens = len(hits) * BLOCK_SIZE
        copies = self.bm.allocate_slots(r, r.num_tokens - r.num_computed_tokens, hits, use_watermark=True)
        if copies is None:
            assert r.request_id not in self.bm.block_tables
            return
        self.bm.record_prefix_hits(r, hits)
        if hits:
            event("prefix hit")
        self._compute(r, copies)
        self.running[r.request_id] = r

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100), token=st.integers(1, 4))
    def append_token(self, pick, token):
        r = list(self.running.values())[pick % len(self.running)]
        r.all_token_ids.append(token)
        while (copies := self.bm.allocate_slots(r, 1)) is None:  # preempt the newest, maybe r itself
            self.n += 1
            victim = list(self.running)[-1]
            self._preempt_newest()
            if victim == r.request_id:
                return
        self._compute(r, copies)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100), cut=st.integers(1, 100))
    def fork(self, pick, cut):
        parent = list(self.running.values())[pick % len(self.running)]
        self.n += 1
        num_tokens = 1 + cut % parent.num_computed_tokens
        child = Req(f"r{self.n}", parent.all_token_ids[:num_tokens], num_computed_tokens=num_tokens - 1)
        self.bm.fork(parent.request_id, child.request_id, num_tokens)
        copies = self.bm.allocate_slots(child, 1)
        if copies is None:
            self.bm.free(child.request_id)
            return
        self._compute(child, copies)
        self.running[child.request_id] = child

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick):
        rid = list(self.running)[pick % len(self.running)]
        self.bm.free(rid)
        del self.running[rid]

    @precondition(lambda self: self.running)
    @rule()
    def preempt(self):
        self.n += 1
        self._preempt_newest()

    @precondition(lambda self: self.swapped)
    @rule()
    def swap_in(self):
        rid = next(iter(self.swapped))
        r = self.swapped[rid]
        if not self.bm.can_swap_in(r, use_watermark=False):
            return
        self._copy(self.bm.swap_in(rid), self.cpu, self.gpu)
        event("swap in")
        self._compute(r, self.bm.allocate_slots(r, r.num_tokens - r.num_computed_tokens))  # a pending token
        self.running[rid] = self.swapped.pop(rid)

    # --- invariants after every step
    @invariant()
    def ref_counts_and_free_list_agree(self):
        self.bm.check_invariants()
        held = {b for t in self.bm.block_tables.values() for b in t}
        assert self.bm.num_free_blocks == self.bm.num_blocks - len(held)  # nothing leaked
        assert set(self.bm.block_tables) == set(self.running)

    @invariant()
    def every_request_reads_its_own_tokens(self):
        for r in self.running.values():
            table = self.bm.block_tables[r.request_id]
            assert len(table) == self.bm.num_blocks_for(r.num_tokens)
            kv = [self.gpu[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(r.num_computed_tokens)]
            assert kv == r.all_token_ids[: r.num_computed_tokens]

    @invariant()
    def slots_used_counts_each_physical_slot_once(self):
        reqs = list(self.running.values())
        slots = {(self.bm.block_tables[r.request_id][p // BLOCK_SIZE], p % BLOCK_SIZE)
                 for r in reqs for p in range(r.num_computed_tokens)}
        assert self.bm.num_slots_used(reqs) == len(slots)
        if reqs:  # a request listed twice holds nothing more
            assert self.bm.num_slots_used(reqs + reqs[:1]) == len(slots)

    def teardown(self):
        for rid in list(self.running):
            self.bm.free(rid)
        for rid in list(self.swapped):
            self.bm.free_cpu_blocks.extend(self.bm.cpu_block_tables.pop(rid))
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.num_free_cpu_blocks == self.bm.num_cpu_blocks


# 250 examples x up to 60 steps: about 12.5k operations per CI run (counted once: 10.2k at 200)
BlockManagerMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=60, deadline=None)
TestBlockManagerProperties = BlockManagerMachine.TestCase
