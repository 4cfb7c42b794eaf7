"""The contiguous KV allocator of the paged-KV contrast lesson, on hand-computed layouts."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minibatch.kv.contiguous import (  # noqa: E402
    SMOLLM2_135M_KV_BYTES_PER_TOKEN, ContiguousAllocator, FragmentationError, OutOfSlotsError, PagedAllocator,
    compaction_bytes, kv_bytes_per_token,
)
from minibatch.lessons.contiguous import print_demo  # noqa: E402
from minibatch.experiments.fragmentation import DEMO_EVENTS, Event, fragmentation_demo  # noqa: E402
from minibatch.viz.contiguous import plot_demo  # noqa: E402


def demo_state() -> ContiguousAllocator:
    """The demo's memory after "-C": E at (8, 4), D at (22, 7); holes 8, 10 and 3 long.

    ........EEEE..........DDDDDDD...
    """
    a = ContiguousAllocator(32)
    for rid, n in (("A", 8), ("B", 6), ("C", 8), ("D", 7)):
        a.allocate(rid, n)
    a.free("B")
    assert a.allocate("E", 4) == 8  # first fit: B's hole
    a.free("A")
    a.free("C")
    return a


def test_first_fit_places_in_lowest_extent_that_fits():
    a = ContiguousAllocator(20)
    assert [a.allocate(r, 5) for r in "xyz"] == [0, 5, 10]
    a.free("x")
    assert a.free_extents == [(0, 5), (15, 5)]
    assert a.allocate("w", 3) == 0  # both holes fit: the lower one, not the best fit
    assert a.free_extents == [(3, 2), (15, 5)]
    assert a.allocate("v", 4) == 15  # (3, 2) is too short
    assert a.free_extents == [(3, 2), (19, 1)]
    assert a.regions == {"y": (5, 5), "z": (10, 5), "w": (0, 3), "v": (15, 4)}
    assert a.allocate("u", 2) == 3 and a.free_extents == [(19, 1)]  # an exact fit removes the extent


def test_free_merges_left_right_and_both_neighbours():
    a = ContiguousAllocator(40)
    for r in "abcd":
        a.allocate(r, 10)
    assert a.free("b") == (10, 10) and a.free_extents == [(10, 10)]
    assert a.free("a") == (0, 20) and a.free_extents == [(0, 20)]  # right neighbour
    assert a.free("c") == (0, 30) and a.free_extents == [(0, 30)]  # left neighbour
    a.allocate("e", 5)
    a.allocate("f", 5)  # e (0,5) f (5,5) free (10,20) d (30,10)
    a.free("d")
    assert a.free_extents == [(10, 30)]
    a.free("e")
    assert a.free_extents == [(0, 5), (10, 30)]
    a.free("f")  # both neighbours
    assert a.free_extents == [(0, 40)]
    assert a.num_free_slots == 40 and a.largest_free_extent == 40 and a.external_fragmentation == 0.0


def test_fragmentation_error_when_total_free_suffices():
    a = demo_state()
    assert a.num_free_slots == 21 and a.largest_free_extent == 10
    assert a.external_fragmentation == pytest.approx(1 - 10 / 21)
    before = (list(a.free_extents), dict(a.regions))
    with pytest.raises(FragmentationError, match=r"21 are free.*largest 10.*fragmentation") as exc:
        a.allocate("F", 12)
    assert not isinstance(exc.value, OutOfSlotsError) and isinstance(exc.value, RuntimeError)
    assert (a.free_extents, a.regions) == before  # a refusal changes nothing
    assert a.allocate("G", 10) == 12  # the largest hole still fits exactly


def test_out_of_memory_is_a_different_error():
    a = demo_state()
    with pytest.raises(OutOfSlotsError, match=r"only 21 of 32 are free \(out of memory\)") as exc:
        a.allocate("F", 22)
    assert not isinstance(exc.value, FragmentationError)
    full = ContiguousAllocator(4)
    full.allocate("a", 4)
    assert full.external_fragmentation == 0.0 and full.largest_free_extent == 0
    with pytest.raises(OutOfSlotsError):
        full.allocate("b", 1)


def test_compact_moves_hand_computed_slots_then_allocation_succeeds():
    a = demo_state()
    with pytest.raises(FragmentationError):
        a.allocate("F", 12)
    assert a.compact() == 4 + 7  # E (8,4) -> (0,4), D (22,7) -> (4,7)
    assert a.regions == {"E": (0, 4), "D": (4, 7)}
    assert a.free_extents == [(11, 21)] and a.external_fragmentation == 0.0
    assert a.allocate("F", 12) == 11
    assert a.compact() == 0  # already packed


def test_compact_does_not_count_regions_already_in_place():
    a = ContiguousAllocator(20)
    for r in "abc":
        a.allocate(r, 5)
    a.free("b")
    assert a.compact() == 5  # only c moves
    assert a.regions == {"a": (0, 5), "c": (5, 5)} and a.free_extents == [(10, 10)]
    a.allocate("d", 10)
    assert a.free_extents == [] and a.compact() == 0  # full: no free extent to create


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"])
def test_compact_preserves_contents_and_ownership(kind):
    a = demo_state()
    a.allocate("x", 2)  # first fit: (0, 2)
    a.free("x")
    a.allocate("y", 3)  # (0, 3)
    a.allocate("z", 9)  # (12, 9): a move of 9 slots by 9
    a.free("y")  # regions: E (8,4), z (12,9), D (22,7)
    original = np.arange(32 * 2).reshape(32, 2)  # (num_slots, 2): any per-slot payload
    if kind == "list":
        kv = [tuple(row) for row in original]
    elif kind == "numpy":
        kv = original.copy()
    else:
        torch = pytest.importorskip("torch")
        kv = torch.tensor(original)
    before = dict(a.regions)
    assert a.compact(kv) == 4 + 9 + 7
    assert list(a.regions) == list(before)  # same requests, same allocation order
    assert [a.regions[r] for r in ("E", "z", "D")] == [(0, 4), (4, 9), (13, 7)]  # address order kept
    assert a.slot_map()[:20] == ["E"] * 4 + ["z"] * 9 + ["D"] * 7
    for rid, (old_start, length) in before.items():
        new_start = a.regions[rid][0]
        got = np.asarray([list(row) for row in kv[new_start:new_start + length]])
        np.testing.assert_array_equal(got, original[old_start:old_start + length])


def test_overlapping_slide_copies_correctly():
    a = ContiguousAllocator(10)
    a.allocate("a", 2)
    a.allocate("b", 6)  # (2, 6) slides to (0, 6): source and destination overlap
    a.free("a")
    kv = np.arange(10)
    assert a.compact(kv) == 6
    np.testing.assert_array_equal(kv[:6], [2, 3, 4, 5, 6, 7])


def test_views():
    a = demo_state()
    assert a.render() == "........EEEE..........DDDDDDD..."
    assert a.labels == {"A": "A", "B": "B", "C": "C", "D": "D", "E": "E"}
    assert a.slot_map().count(None) == a.num_free_slots == 21
    assert a.num_allocated_slots == 11


@pytest.mark.parametrize("num_slots", [0, -3, 2.5, True])
def test_invalid_num_slots(num_slots):
    with pytest.raises(ValueError, match="num_slots"):
        ContiguousAllocator(num_slots)


def test_invalid_allocate_and_free_arguments():
    a = ContiguousAllocator(8)
    for bad in (-2, 0):
        with pytest.raises(ValueError, match="num_slots must be an int >= 1"):
            a.allocate("a", bad)
    with pytest.raises(ValueError, match="request_id"):
        a.allocate("", 2)
    a.allocate("a", 2)
    with pytest.raises(ValueError, match="request_id 'a' already"):
        a.allocate("a", 2)
    with pytest.raises(KeyError, match="request_id 'nope'"):
        a.free("nope")
    a.free("a")
    with pytest.raises(KeyError, match="request_id 'a'"):
        a.free("a")  # twice


def test_compaction_bytes_for_smollm2():
    assert SMOLLM2_135M_KV_BYTES_PER_TOKEN == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(30, 3, 64, dtype_bytes=2) == 23_040
    assert compaction_bytes(11, SMOLLM2_135M_KV_BYTES_PER_TOKEN) == 506_880
    with pytest.raises(ValueError, match="num_slots_moved"):
        compaction_bytes(-1, 10)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        compaction_bytes(1, 0)


def test_paged_allocator_any_block_anywhere():
    p = PagedAllocator(num_blocks=8, block_size=4)
    assert p.allocate("a", 6) == [0, 1] and p.allocate("b", 8) == [2, 3]
    assert p.internal_fragmentation_slots == 2
    assert p.free("a") == [0, 1]
    assert p.allocate("c", 20) == [4, 5, 6, 7, 0]  # freed blocks go to the back of the list
    assert p.block_map() == ["c", None, "b", "b", "c", "c", "c", "c"]
    assert p.block_fill() == [4, 0, 4, 4, 4, 4, 4, 4]
    with pytest.raises(OutOfSlotsError, match="needs 2 KV blocks, only 1"):
        p.allocate("d", 5)
    with pytest.raises(ValueError, match="request_id 'b' already"):
        p.allocate("b", 1)
    with pytest.raises(KeyError, match="request_id 'zz'"):
        p.free("zz")
    with pytest.raises(ValueError, match="block_size"):
        PagedAllocator(4, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        PagedAllocator(0, 4)


def test_fragmentation_demo_records():
    steps = fragmentation_demo()
    assert [s.event.label for s in steps][-4:] == ["-C", "+F 12", "compact", "+F 12 (retry)"]
    refused = [s for s in steps if s.refused]
    assert len(refused) == 1
    r = refused[0]
    assert (r.event.request_id, r.refused, r.num_free_slots, r.largest_free_extent) == ("F", "fragmentation", 21, 10)
    assert r.free_extents == [(0, 8), (12, 10), (29, 3)] and r.start is None
    assert r.block_table is not None and not r.paged_refused  # paging places F at once
    compact, retry = steps[-2], steps[-1]
    assert compact.num_slots_moved == 11 and retry.start == 11 and retry.free_extents == [(23, 9)]
    assert not any(s.paged_refused for s in steps)
    for s in steps:  # paging wastes at most block_size - 1 slots per request
        num_requests = len({rid for rid in s.block_map if rid is not None})
        assert s.internal_fragmentation_slots <= 3 * num_requests
        assert s.num_free_slots + sum(rid is not None for rid in s.slot_map) == 32
    assert steps[3].internal_fragmentation_slots == 2 + 1  # B 6 in 8, D 7 in 8


def test_fragmentation_demo_without_compaction_and_out_of_memory():
    events = DEMO_EVENTS + (Event("finish", "F"), Event("arrive", "G", 40))
    steps = fragmentation_demo(events, compact=False)
    assert len(steps) == len(events)
    assert [s.refused for s in steps[-3:]] == ["fragmentation", None, "out of memory"]
    assert [s.paged_refused for s in steps[-3:]] == [False, False, True]
    with pytest.raises(ValueError, match="event kind"):
        fragmentation_demo([Event("teleport", "A", 1)])
    with pytest.raises(ValueError, match="multiple of block_size"):
        fragmentation_demo(num_slots=30, block_size=4)


def test_print_and_plot_demo(capsys):
    steps = fragmentation_demo()
    print_demo(steps)
    out = capsys.readouterr().out
    assert "REFUSED: fragmentation" in out and "moved 11 slots" in out
    assert "........EEEE..........DDDDDDD..." in out
    fig = plot_demo(steps, kv_bytes_per_token=SMOLLM2_135M_KV_BYTES_PER_TOKEN)
    ax_c, ax_p = fig.axes
    assert ax_c.get_xlim() == (0, 32) and ax_p.get_xlim() == (0, 32)
    assert ax_c.get_ylim() == (len(steps), 0)
    labels = [t.get_text() for t in ax_c.get_yticklabels()]
    assert "compact: 11 slots moved = 0.48 MiB" in labels
    plt.close(fig)


# sizes up to 12 in up to 40 slots, compaction rarer than allocate/free: every outcome occurs
ops = st.lists(st.tuples(st.sampled_from(["allocate", "allocate", "free", "free", "compact"]),
                         st.integers(1, 12)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_slots=st.integers(1, 40), ops=ops)
def test_random_sequences_never_overlap(num_slots, ops):
    a = ContiguousAllocator(num_slots)
    next_id = 0
    for op, n in ops:
        if op == "allocate":
            free, largest = a.num_free_slots, a.largest_free_extent
            try:
                start = a.allocate(f"r{next_id}", n)
                assert n <= largest and a.regions[f"r{next_id}"] == (start, n)
            except FragmentationError:
                assert largest < n <= free
            except OutOfSlotsError:
                assert free < n
            next_id += 1
        elif op == "free" and a.regions:
            a.free(list(a.regions)[n % len(a.regions)])
        elif op == "compact":
            a.compact()
            assert len(a.free_extents) <= 1 and a.external_fragmentation == 0.0
        # invariants: regions and free extents tile [0, num_slots) exactly, holes never touch
        spans = sorted(list(a.regions.values()) + a.free_extents)
        assert [s for s, _ in spans] == [sum(x) for x in [(0, 0)] + spans[:-1]]  # no overlap, no gap
        assert sum(spans[-1]) == num_slots
        assert all(sum(x) < y[0] for x, y in zip(a.free_extents, a.free_extents[1:]))  # merged
        assert a.num_free_slots + a.num_allocated_slots == num_slots
        assert a.slot_map().count(None) == a.num_free_slots
