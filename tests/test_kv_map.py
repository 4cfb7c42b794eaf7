"""The KV block map: owner of every block in every step, from hand-built StepRecords."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from minibatch.engine import StepRecord  # noqa: E402
from minibatch.viz.kv_map import (  # noqa: E402
    FREE, SHARED, block_map_array, kv_block_map, natural_key, request_colors,
)

pytestmark = pytest.mark.filterwarnings("error")  # no plotting warnings


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def record(step: int, block_tables: dict[str, list[int]]) -> StepRecord:
    return StepRecord(step=step, start_s=0.1 * step, end_s=0.1 * (step + 1), entries=[], num_padding_tokens=0,
                      num_idle_rows=0, num_kv_slots_used=0, num_kv_slots_reserved=0, num_waiting=0,
                      num_running=len(block_tables), block_tables=block_tables)


# step 0: req-0 holds 0, 1; req-10 holds 2 (req-5's empty table is ignored)
# step 1: req-2 shares block 1 with req-0 (prefix cache); req-10 grows to 3
# step 2: req-0 and req-10 finished; req-2 holds 1 and 4
TRACE = [record(0, {"req-0": [0, 1], "req-10": [2], "req-5": []}),
         record(1, {"req-0": [0, 1], "req-10": [2, 3], "req-2": [1]}),
         record(2, {"req-2": [1, 4]})]
EXPECTED = np.array([[0, 0, 2, FREE, FREE, FREE],  # ids: 0 = req-0, 1 = req-2, 2 = req-10
                     [0, SHARED, 2, 2, FREE, FREE],
                     [FREE, 1, FREE, FREE, 1, FREE]])


def test_block_map_array_exact():
    owners, ids = block_map_array(TRACE, num_blocks=6)
    assert ids == ["req-0", "req-2", "req-10"]  # natural order, not "req-10" < "req-2"
    assert owners.shape == (3, 6)
    np.testing.assert_array_equal(owners, EXPECTED)
    assert (FREE, SHARED) == (-1, -2)


def test_block_listed_twice_by_one_request_is_not_shared():
    owners, ids = block_map_array([record(0, {"a": [1, 1]})], num_blocks=2)
    assert ids == ["a"] and owners.tolist() == [[FREE, 0]]


def test_block_map_array_errors_and_empty():
    with pytest.raises(ValueError, match="num_blocks"):
        block_map_array(TRACE, 0)
    with pytest.raises(ValueError, match=r"block_id 4, outside \[0, num_blocks=4\)"):
        block_map_array(TRACE, 4)
    owners, ids = block_map_array([], 3)
    assert owners.shape == (0, 3) and ids == []


def test_request_colors_stable_sorted_and_cycling():
    ids = [f"req-{i}" for i in range(12)]
    colors = request_colors(reversed(ids))
    assert list(colors) == ids
    assert colors == request_colors(ids)
    assert colors["req-7"] == colors["req-0"] and len({colors[f"req-{i}"] for i in range(7)}) == 7  # 7, cycling
    assert sorted(["b10", "b9", "a"], key=natural_key) == ["a", "b9", "b10"]


def test_kv_block_map_cells_limits_and_legend():
    ax = kv_block_map(TRACE, num_blocks=6)
    assert isinstance(ax.figure, plt.Figure)
    assert ax.get_xlim() == (0, 3) and ax.get_ylim() == (6, 0)
    owned, shared = ax.collections
    assert (owned.get_gid(), shared.get_gid()) == ("owned", "shared")
    # runs of one owner over consecutive steps: block 0 (req-0 x2), block 1 (req-0, req-2),
    # block 2 (req-10 x2), block 3 (req-10), block 4 (req-2); block 1 at step 1 is shared
    assert len(owned.get_paths()) == 6 and len(shared.get_paths()) == 1
    assert shared.get_hatch()
    np.testing.assert_array_equal(shared.get_paths()[0].vertices[:4], [[1, 1], [2, 1], [2, 2], [1, 2]])
    np.testing.assert_array_equal(owned.get_paths()[0].vertices[:4], [[0, 0], [2, 0], [2, 1], [0, 1]])
    colors = request_colors(["req-0", "req-2", "req-10"])
    np.testing.assert_allclose(owned.get_facecolors()[0], to_rgba(colors["req-0"]))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["req-0", "req-2", "req-10", "shared"]


def test_kv_block_map_max_steps_given_ax_and_step_gaps():
    fig, ax = plt.subplots()
    assert kv_block_map(TRACE, 6, ax=ax, max_steps=1) is ax
    assert ax.get_xlim() == (0, 1) and len(ax.collections) == 1  # no sharing in step 0
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["req-0", "req-10"]
    gaps = [record(5, {"a": [0]}), record(6, {"a": [0]}), record(9, {"a": [0]})]
    ax = kv_block_map(gaps, 1, legend=False)
    assert ax.get_xlim() == (5, 10) and ax.get_legend() is None
    assert len(ax.collections[0].get_paths()) == 2  # steps 5-6 merged; 9 stands alone
    with pytest.raises(ValueError, match="max_steps"):
        kv_block_map(TRACE, 6, max_steps=0)


def test_kv_block_map_empty_trace():
    ax = kv_block_map([], 4)
    assert ax.get_xlim() == (0, 1) and ax.get_ylim() == (4, 0) and not ax.collections
