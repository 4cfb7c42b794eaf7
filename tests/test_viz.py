"""viz renders SimExecutor runs; the Gantt chart draws exactly one cell per trace row."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minibatch import SimClock, SimExecutor, make_engine  # noqa: E402
from minibatch.metrics import SLO, summarize  # noqa: E402
from minibatch.viz import (  # noqa: E402
    compare_gantt, gantt, gantt_cells, latency_cdf, save, short_id, throughput_latency_bars,
)
from minibatch.workload import make_trace  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error")  # no plotting warnings (e.g. layout)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def runs():
    """policy -> (finished requests, trace) on one small Poisson trace."""
    trace = make_trace(8, arrival="poisson", rate_per_s=5.0, lengths="uniform", prompt_range=(4, 24),
                       output_range=(1, 12), seed=3)
    out = {}
    for policy in ("static", "orca"):
        engine = make_engine(policy, SimExecutor(), SimClock(),
                             config={"batch_size": 3, "max_num_seqs": 3, "max_wait_s": 0.1})
        out[policy] = (engine.generate([r.copy() for r in trace]), engine.trace)
    return out


def drawn_cells(ax) -> dict[str, int]:
    return {c.get_gid(): len(c.get_paths()) for c in ax.collections}


@pytest.mark.parametrize("policy", ["static", "orca"])
@pytest.mark.parametrize("x", ["step", "time"])
def test_gantt_slot_rows_match_trace(runs, policy, x):
    requests, trace = runs[policy]
    ax = gantt(trace, x=x, title=policy)
    cells = drawn_cells(ax)
    for phase in ("prefill", "decode", "padding"):
        assert cells.get(phase, 0) == sum(e.phase == phase for r in trace for e in r.entries)
    assert cells["idle"] == sum(r.num_idle_rows for r in trace)
    assert len(ax.get_yticklabels()) == 3  # max_num_seqs slots
    assert cells.get("padding", 0) > 0 if policy == "static" else "padding" not in cells


def test_gantt_request_rows_waiting_and_finished(runs, tmp_path):
    requests, trace = runs["static"]
    cells, names = gantt_cells(trace, rows="request", requests=requests)
    assert names == [r.request_id for r in requests]
    by_kind = {k: [c for c in cells if c.kind == k] for k in ("prefill", "waiting", "finished", "idle")}
    assert len(by_kind["prefill"]) == len(requests) and not by_kind["idle"]
    # one span: the steps between a request's arrival and its first step; finished after its last
    first_step = {e.request_id: r.step for r in reversed(trace) for e in r.entries}
    last_step = {e.request_id: r.step for r in trace for e in r.entries}
    for req in requests:
        rid = req.request_id
        waited = sum(req.arrival_time_s <= r.start_s for r in trace[: first_step[rid]])
        assert [(c.x0, c.width) for c in by_kind["waiting"] if c.request_id == rid] == (
            [(first_step[rid] - waited, waited)] if waited else [])
        done = len(trace) - 1 - last_step[rid]
        assert [(c.x0, c.width) for c in by_kind["finished"] if c.request_id == rid] == (
            [(last_step[rid] + 1, done)] if done else [])
    assert by_kind["waiting"] and by_kind["finished"]
    ax = gantt(trace, rows="request", requests=requests)
    assert drawn_cells(ax)["waiting"] == len(by_kind["waiting"])
    ax.figure.savefig(tmp_path / "requests.png")
    ax = gantt(trace, rows="request", x="time", requests=requests)
    waiting = [c for c in gantt_cells(trace, "request", "time", requests)[0] if c.kind == "waiting"]
    queued = {r.request_id: r for r in requests if r.first_scheduled_time_s > r.arrival_time_s}
    assert sorted(c.request_id for c in waiting) == sorted(queued)
    for c in waiting:  # time mode: from the arrival itself to the first scheduled step
        r = queued[c.request_id]
        assert (c.x0, c.x0 + c.width) == pytest.approx((r.arrival_time_s, r.first_scheduled_time_s))


def test_gantt_rejects_unknown_rows(runs):
    with pytest.raises(ValueError, match="rows"):
        gantt_cells(runs["orca"][1], rows="slots")


def test_short_id():
    assert [short_id(i) for i in ("req-007", "req-120", "x0", "alpha")] == ["7", "120", "0", "alph"]


def test_compare_and_save(runs, tmp_path):
    fig = compare_gantt({p: t for p, (_, t) in runs.items()})
    path = save(fig, "gantt_static_vs_orca", figures_dir=tmp_path / "figures")
    assert path == tmp_path / "figures" / "gantt_static_vs_orca.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(fig.axes) == 4  # each policy's Gantt, then its KV usage strip
    assert len(compare_gantt({p: t for p, (_, t) in runs.items()}, kv=False).axes) == 2
    orca_first = compare_gantt({p: runs[p][1] for p in ("orca", "static")})
    legend = [t.get_text() for t in orca_first.axes[0].get_legend().get_texts()]
    assert "padding" in legend and "prefill" in legend  # kinds of every policy, not only the first one's


def test_kv_strip_bars_are_the_steps_slot_counts(runs):
    trace = runs["orca"][1]
    ax = gantt(trace)
    strip = ax.figure.axes[1]
    reserved, used = strip.containers  # drawn reserved first (outline), used on top
    assert [b.get_height() for b in used] == [r.num_kv_slots_used for r in trace]
    assert [b.get_height() for b in reserved] == [r.num_kv_slots_reserved for r in trace]
    assert [b.get_x() for b in used] == [r.step for r in trace]
    assert max(r.num_kv_slots_reserved for r in trace) >= max(r.num_kv_slots_used for r in trace) > 0


@pytest.mark.parametrize("metric", ["ttft", "tpot", "e2e", "itl"])
def test_latency_cdf(runs, metric):
    ax = latency_cdf({p: reqs for p, (reqs, _) in runs.items()}, metric=metric)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["static", "orca"]
    for line in ax.get_lines():
        assert line.get_ydata()[-1] == 1.0


def test_throughput_latency_bars(runs, tmp_path):
    summaries = {p: summarize(reqs, trace, SLO(ttft_s=0.5)) for p, (reqs, trace) in runs.items()}
    ax_tput, ax_ttft = throughput_latency_bars(summaries)
    heights = [b.get_height() for b in ax_tput.patches]
    assert heights == pytest.approx([s.output_throughput_tok_s for s in summaries.values()])
    assert save(ax_tput.figure, "bars", tmp_path).exists()
