"""The calibrated simulator: step shapes, the fit, calibrate / simulate on the command
line, Chrome trace export and the step-through widget."""

import json
from pathlib import Path
from dataclasses import asdict

import matplotlib
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch.__main__ import main
from minibatch.sim.simulator import parse_acceptance_rate
from minibatch.engine import Engine
from minibatch.policies import make_engine
from minibatch.request import Request, SamplingParams
from minibatch.sim.executor import SimExecutor
from minibatch.scheduler import PagedScheduler, StaticScheduler
from minibatch.clock import SimClock
from minibatch.clock import StepShape
from minibatch.sim.cost_model import LayoutModel, Profile, fit_layout, hat_basis
from minibatch.sim.profile_format import layout_problem
from minibatch.viz.chrome_trace import chrome_trace, write_chrome_trace
from minibatch.workload import make_trace

matplotlib.use("Agg")
GREEDY = SamplingParams(ignore_eos=True)


# ---------------------------------------------------------------------- step shapes
@pytest.mark.parametrize("policy,kwargs", [
    ("static", dict(batch_size=3)), ("orca", {}), ("paged", dict(block_size=4)),
    ("chunked", dict(block_size=4, max_num_batched_tokens=16)), ("spec", dict(block_size=4)),
])
def test_clock_prices_the_record_shape(policy, kwargs):
    """The simulated clock prices StepShape.of(record): each record's duration is the cost model's
    time for its shape plus its draft forwards'; the layout comes from the record."""
    reqs = [Request(f"r{i}", list(range(3, 3 + p)), o, GREEDY, arrival_time_s=0.01 * i)
            for i, (p, o) in enumerate([(5, 4), (30, 2), (9, 7), (2, 5), (17, 3)])]
    clock = SimClock()
    ex = SimExecutor(acceptance_rate=0.5) if policy == "spec" else SimExecutor()
    engine = make_engine(policy, ex, clock, config={"n_slots": 256}, **kwargs)
    engine.generate(reqs)
    shapes = [StepShape.of(r) for r in engine.trace]
    for rec, shape in zip(engine.trace, shapes):
        draft = sum(clock.draft_cost_model.forward_time_s(*f) for f in rec.draft_forwards)
        assert rec.duration_s == pytest.approx(clock.cost_model.step_time_s(shape) + draft, rel=1e-12)
        assert shape.padded == (policy == "static")
    if policy == "chunked":
        assert any(s.logits < len(r.entries) for s, r in zip(shapes, engine.trace))  # a chunk computes no logits
    if policy == "spec":
        assert any(s.logits > len(r.entries) for s, r in zip(shapes, engine.trace))  # 1 + k logits per verify
        assert any(r.draft_forwards for r in engine.trace)


def test_shape_hand_computed():
    """One prefill of 5 tokens (new 5, cached 0), a chunk of 4 after 8 cached (no logits), and two
    decodes with 10 and 20 cached tokens: N = 11, logits 3, two attention calls over 5*5 + 4*12
    pairs, decode attention 2 rows x 21 (the longer context, its new token included)."""
    from minibatch.engine import StepRecord
    from minibatch.records import StepEntry

    entries = [StepEntry("a", 0, "prefill", 5, 0), StepEntry("b", 1, "prefill", 4, 8, sampled=False),
               StepEntry("c", 2, "decode", 1, 10), StepEntry("d", 3, "decode", 1, 20)]
    rec = StepRecord(0, 0.0, 1.0, entries, num_padding_tokens=0, num_idle_rows=0, num_kv_slots_used=0,
                     num_kv_slots_reserved=0, num_waiting=0, num_running=4)
    assert StepShape.of(rec) == StepShape(num_tokens=11, logits=3, prefill_rows=2, prefill_attention=25 + 48,
                                          decode_attention=2 * 21, rows=4, context=5 + 12 + 11 + 21)


# ---------------------------------------------------------------------- the fit
def test_hat_basis_interpolates_and_extrapolates():
    knots = [1, 2, 4, 8]
    values = np.array([10.0, 12.0, 13.0, 17.0])
    B = hat_basis(np.array([1, 3, 8, 12]), knots)
    assert np.allclose(B @ values, [10.0, 12.5, 17.0, 21.0])  # 12 extends the last segment (slope 1)
    assert np.allclose(B.sum(axis=1), 1.0)


def test_fit_recovers_a_known_model():
    """Steps priced by a known piecewise-linear model are fit back within 2%."""
    rng = np.random.default_rng(0)
    truth = LayoutModel(knots=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512], coef_s={
        "logits": 2e-4, "prefill_rows": 3e-3, "prefill_attention": 2e-6, "decode_attention": 1e-5},
        curve_s=[0.05, 0.08, 0.085, 0.09, 0.1, 0.13, 0.18, 0.3, 0.55, 1.0])
    shapes = []
    for _ in range(400):
        n_dec = int(rng.integers(0, 32))
        ctx = int(rng.integers(1, 400))
        chunk = int(rng.choice([0, 0, int(rng.integers(2, 300))]))
        shapes.append(StepShape(num_tokens=max(1, n_dec + chunk), logits=max(1, n_dec + (chunk > 0)),
                                prefill_rows=int(chunk > 0), prefill_attention=chunk * (chunk + ctx),
                                decode_attention=n_dec * ctx))
    times = truth.predict(shapes) * rng.normal(1.0, 0.01, len(shapes))
    fit = fit_layout(shapes, times.tolist())
    rel = np.abs(fit.predict(shapes) - times) / times
    assert np.median(rel) < 0.02
    assert fit.knots[0] == 1 and fit.knots[-1] >= 256
    assert all(v >= 0 for v in fit.curve_s) and all(v >= 0 for v in fit.coef_s.values())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.floats(1e-4, 1e-2)), min_size=24, max_size=80))
def test_fit_curve_is_positive_and_non_decreasing(steps):
    """Whatever the times (noisy, or decodes where logits == num_tokens so the curve and the
    logits term are collinear), every knot is > 0 and the curve never drops: a profile that
    calibrate writes is one the loader accepts."""
    shapes = [StepShape(num_tokens=n, logits=n, decode_attention=n * 20) for n, _ in steps]
    fit = fit_layout(shapes, [t for _, t in steps])
    assert all(v > 0 for v in fit.curve_s)
    assert all(b >= a * (1 - 1e-9) for a, b in zip(fit.curve_s, fit.curve_s[1:]))
    assert layout_problem(asdict(fit)) is None


def test_fit_errors():
    with pytest.raises(ValueError, match="> 0 seconds"):
        fit_layout([StepShape(1, 1)] * 20, [0.0] * 20)
    with pytest.raises(ValueError, match="at least"):
        fit_layout([StepShape(1, 1)], [0.1])


def test_profile_round_trip(tmp_path):
    m = LayoutModel(knots=[1, 2], curve_s=[0.01, 0.02], coef_s=dict.fromkeys(
        ("logits", "prefill_rows", "prefill_attention", "decode_attention"), 0.0))
    p = Profile("toy", {"packed": m}, draft=m, meta={"command": "x"})
    q = Profile.load(p.save(tmp_path / "p" / "toy.json"))
    assert q.layouts["packed"] == m and q.draft == m and q.meta["command"] == "x" and q.model == "toy"
    shape = StepShape(num_tokens=2, logits=1)
    assert q.predict([shape])[0] == pytest.approx(0.02)
    assert q.predict([StepShape(num_tokens=2, logits=1, padded=True)])[0] == pytest.approx(0.02)  # packed stands in
    assert q.forward_time_s(1, 1, 10) == pytest.approx(0.01)
    (tmp_path / "bad.json").write_text(json.dumps({"format": "nope"}))
    with pytest.raises(ValueError, match="format"):
        Profile.load(tmp_path / "bad.json")


def test_repeat_spread_is_each_step_against_its_own_shapes_median():
    """Hand-computed: a shape measured at 1.0 and 1.2 s lies 0.1 / 1.1 from its median both times; a shape measured
    at 2, 2 and 2.6 s: 0, 0 and 0.3; shapes measured once, or equal in every feature but the layout, are no repeat."""
    from minibatch.sim.cost_model import repeat_spread

    a, b = StepShape(num_tokens=4, logits=4), StepShape(num_tokens=8, logits=1, decode_attention=64)
    shapes = [a, a, b, b, b, StepShape(num_tokens=4, logits=4, padded=True), StepShape(num_tokens=5, logits=5)]
    out = repeat_spread(shapes, [1.0, 1.2, 2.0, 2.0, 2.6, 9.0, 9.0])
    dev = np.array([0.1 / 1.1, 0.1 / 1.1, 0.0, 0.0, 0.3])
    assert out == {"median": pytest.approx(np.median(dev)), "p90": pytest.approx(np.quantile(dev, 0.9)), "steps": 5}
    assert repeat_spread([a, b], [1.0, 2.0]) == {"median": None, "p90": None, "steps": 0}


# ---------------------------------------------------------------------- calibrate and simulate
@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory, one_thread):
    path = tmp_path_factory.mktemp("profiles") / "tiny.json"
    assert main(["calibrate", "--dtype", "float32", "--model", "tiny-random-llama", "--scale", "0.25",
                 "--draft-model", "tiny-random-llama",
                 "--out", str(path), "--no-progress"]) == 0
    return path


def test_calibrate_writes_a_profile_that_fits_its_samples(tiny_profile):
    p = Profile.load(tiny_profile)
    assert set(p.layouts) == {"packed", "padded"} and p.draft is not None
    assert p.meta["command"].startswith("python -m minibatch calibrate")
    assert p.max_model_len == 512 and p.vocab_size == 512  # tiny-random-llama's context and vocab: simulate checks
    samples = p.meta["samples"]
    assert {s["scenario"].split("-")[0] for s in samples} >= {"decode", "long", "prefill", "chunked", "static"}
    for layout in ("packed", "padded"):
        rows = [s for s in samples if s["layout"] == layout]
        shapes = [StepShape.from_sample(s) for s in rows]
        pred = p.layouts[layout].predict(shapes)
        total = np.sum([s["time_s"] for s in rows])
        assert abs(pred.sum() - total) / total < 0.25  # a tiny model's steps are noisy (~1 ms)
        assert p.meta["fit_error"][layout]["median"] < 0.5
        assert p.meta["repeat_spread"][layout]["steps"] > 0  # some scenarios measure a shape more than once


def test_a_variant_calibration_never_replaces_the_full_profile_and_a_draft_is_measured_where_its_profile_was(
        tiny_profile, capsys, monkeypatch):
    """calibrate's default --out named only model, device and dtype: a --quick, --scale or other-backend run
    replaced the full profile. --draft-only measured the draft on --device (default cpu) and at --scale (default 1),
    whatever the profile's."""
    from minibatch.sim import calibrate
    from minibatch.sim.calibrate import calibrate_draft, default_profile_path

    assert default_profile_path("smollm2-135m", "cpu", "float32") == "data/profiles/smollm2-135m-cpu.json"
    assert default_profile_path("smollm2-135m", "cpu", "bfloat16", quick=True) == \
        "data/profiles/smollm2-135m-cpu-bfloat16-quick.json"  # the committed quick profile's name
    assert default_profile_path("a/b", "cuda:1", "bfloat16", "triton", True, 0.1, True) == \
        "data/profiles/a_b-cuda1-bfloat16-triton-quick-scale0.1-eager.json"
    profile = Profile.load(tiny_profile)
    scales = []

    def scenarios_at(vocab_size, scale, grid):
        scales.append(scale)
        raise RuntimeError("stop here")

    monkeypatch.setattr(calibrate, "draft_scenarios", scenarios_at)
    with pytest.raises(RuntimeError, match="stop here"):
        calibrate_draft(profile, "tiny-random-llama")  # at the profile's own scale, not 1
    assert scales == [0.25]
    profile.meta["device"] = "cuda:1"
    with pytest.raises(ValueError, match="--device cpu: the profile was measured on cuda:1"):
        calibrate_draft(profile, "tiny-random-llama", "cpu")
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--model", "tiny-random-llama", "--quick", "--scale", "0.05", "--out",
              str(tiny_profile.with_name("small.json")), "--no-progress"])
    assert info.value.code == 2 and not tiny_profile.with_name("small.json").exists()
    assert "--scale 0.05 with --quick leaves too few steps; give a larger --scale" in capsys.readouterr().err


def test_a_refit_of_damaged_samples_names_the_file(tiny_profile, tmp_path, capsys):
    data = json.loads(tiny_profile.read_text())
    data["samples"][0]["num_tokens"] = "x"  # ('>' not supported between 'int' and 'str', unnamed, before)
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps(data))
    with pytest.raises(SystemExit):
        main(["calibrate", "--refit", str(damaged), "--out", str(tmp_path / "out.json")])
    assert f"{damaged}: its stored samples cannot be fitted again" in capsys.readouterr().err


def test_quick_calibration_covers_every_axis_with_fewer_steps(tmp_path, one_thread):
    """``calibrate --quick`` measures every kind of workload the full grid does, at fewer sizes and steps, and
    still fits both layouts and the draft; the profile says it was quick."""
    from minibatch.request import Request
    from minibatch.sim.workloads import FULL, QUICK, draft_scenarios, scenarios

    def kinds(scs):
        return {sc.name.split("-")[0] for sc in scs}

    def steps(scs):  # tokens to compute, a proxy for the time it takes
        return sum(r.num_prompt_tokens + r.max_new_tokens for sc in scs for r in sc.requests
                   if isinstance(r, Request))

    full, quick = scenarios(1000, grid=FULL), scenarios(1000, grid=QUICK)
    assert kinds(quick) == kinds(full) and steps(quick) < 0.6 * steps(full)
    assert len(draft_scenarios(1000, grid=QUICK)) < len(draft_scenarios(1000))
    path = tmp_path / "quick.json"
    assert main(["calibrate", "--dtype", "float32", "--model", "tiny-random-llama", "--scale", "0.25", "--quick",
                 "--draft-model", "tiny-random-llama", "--out", str(path), "--no-progress"]) == 0
    p = Profile.load(path)
    assert set(p.layouts) == {"packed", "padded"} and p.draft is not None and p.meta["quick"] is True
    assert "--quick" in p.meta["command"]


def test_simulate_says_when_the_profile_is_another_machines(tiny_profile, tmp_path, capsys):
    """A profile calibrated here records this machine (no note); the same profile with another CPU count
    and an older engine gets a note naming both and pointing to calibrate, and the JSON lists them."""
    from minibatch.report import environment, machine_differences

    data = json.loads(Path(tiny_profile).read_text())
    assert machine_differences(data["environment"], environment()) == []
    data["environment"] |= {"cpu_count": 96, "minibatch": "0.0.1"}
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    main(["simulate", "--profile", str(other), "--num-requests", "20", "--policies", "paged", "--no-progress",
          "--json", str(tmp_path / "s.json")])
    note = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("note:"))
    assert "cpu_count: 96 -> " in note and "minibatch: 0.0.1 -> " in note and "calibrate" in note
    assert len(json.loads((tmp_path / "s.json").read_text())["profile_machine_differences"]) == 2


def test_a_profile_from_before_an_engine_change_is_named_stale():
    """A profile records the commit it was calibrated at; where the engine's code (report.ENGINE_PATHS) changed
    since, machine_differences says so. Skipped where git cannot tell (no checkout, or a shallow clone)."""
    import subprocess

    from minibatch.report import ROOT, environment, git_commit, machine_differences

    here = environment()
    if git_commit() is None:
        pytest.skip("not a git checkout")
    last = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h", "--", "minibatch/runner"],
                          capture_output=True, text=True).stdout.strip()
    before = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{last}~1"], capture_output=True,
                            text=True)
    if not last or before.returncode != 0:
        pytest.skip("the history does not reach an engine change")
    stale = machine_differences(here | {"commit": before.stdout.strip()}, here)
    assert len(stale) == 1 and stale[0].startswith(f"engine code changed since commit {before.stdout.strip()}: ")
    assert "minibatch/runner" in stale[0]
    assert machine_differences(here, here) == []
    assert machine_differences(here | {"commit": "0000000"}, here) == []  # not in the history: git cannot tell


def test_simulate_cli_runs_thousands_of_requests(tiny_profile, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--profile", str(tiny_profile), "--num-requests", "1000", "--rate", "200",
                 "--policies", "static,paged,chunked", "--json", str(out), "--no-progress",
                 "--trace-out", str(tmp_path / "traces")]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["clock"] == "sim" and result["num_requests"] == 1000
    for name, entry in result["policies"].items():
        assert entry["num_requests"] == 1000 if "num_requests" in entry else True
        assert entry["output_throughput_tok_s"] > 0
        assert json.loads((tmp_path / "traces" / f"{name}.trace.json").read_text())["traceEvents"]
    assert "paged" in capsys.readouterr().out


def test_simulate_spec_needs_acceptance_rate(tiny_profile, tmp_path):
    with pytest.raises(SystemExit):
        main(["simulate", "--profile", str(tiny_profile), "--policies", "spec", "--no-progress"])
    with pytest.raises(SystemExit):
        main(["simulate", "--profile", str(tiny_profile), "--policies", "hf_generate", "--no-progress"])
    out = tmp_path / "s.json"
    main(["simulate", "--profile", str(tiny_profile), "--policies", "paged,spec", "--acceptance-rate", "0.6,0.3",
          "--num-requests", "20", "--json", str(out), "--no-progress"])
    stats = json.loads(out.read_text())["policies"]["spec"]["spec_decoding"]
    assert 0.4 < stats["acceptance_rate_per_pos"][0] < 0.8


def test_parse_acceptance_rate():
    assert parse_acceptance_rate("0.7") == 0.7
    assert parse_acceptance_rate("0.6,0.3") == [0.6, 0.3]
    assert parse_acceptance_rate(None) is None
    for bad in ("x", "1.5", "0.5,-1"):
        with pytest.raises(ValueError, match="--acceptance-rate"):
            parse_acceptance_rate(bad)


def test_compare_sim_clock_with_profile_is_the_simulator(tiny_profile, tmp_path):
    """compare --clock sim --profile (real model, calibrated clock) and simulate (no model) give
    the same timeline: the schedule does not depend on the tokens (ignore_eos)."""
    common = ["--num-requests", "6", "--max-output-len", "10", "--max-prompt-len", "20", "--rate", "20",
              "--policies", "orca,chunked", "--profile", str(tiny_profile), "--no-progress"]
    main(["compare", "--dtype", "float32", "--model", "tiny-random-llama", "--clock", "sim", "--figures-dir", "",
          "--no-reference",
          "--json", str(tmp_path / "c.json")] + common)
    main(["simulate", "--json", str(tmp_path / "s.json")] + common)
    c, s = (json.loads((tmp_path / f"{x}.json").read_text())["policies"] for x in "cs")
    for policy in ("orca", "chunked"):
        for key in ("duration_s", "ttft_p50_s", "output_throughput_tok_s"):
            assert c[policy][key] == pytest.approx(s[policy][key])


def test_sim_executor_per_position_acceptance_and_proposal_rate():
    reqs = [Request(f"r{i}", [3] * 8, 200, GREEDY) for i in range(8)]
    ex = SimExecutor(acceptance_rate=[0.8, 0.4, 0.1], seed=1, proposal_rate=0.5, draft_forwards=False)
    engine = make_engine("spec", ex, SimClock(), n_slots=8 * 256, num_speculative_tokens=3)
    engine.generate(reqs)
    per_pos = ex.stats.acceptance_rate_per_pos
    assert per_pos[0] == pytest.approx(0.8, abs=0.05) and per_pos[1] == pytest.approx(0.4, abs=0.05)
    assert per_pos[2] == pytest.approx(0.1, abs=0.04)
    decode = [e for r in engine.trace for e in r.entries if e.phase == "decode"]
    assert sum(e.num_spec_tokens > 0 for e in decode) / len(decode) == pytest.approx(0.5, abs=0.05)
    assert all(r.draft_time_s == 0 for r in engine.trace)  # no draft forwards charged
    assert all(r.num_output_tokens == 200 for r in reqs)
    with pytest.raises(ValueError, match="proposal_rate"):
        SimExecutor(acceptance_rate=0.5, proposal_rate=2.0)
    with pytest.raises(ValueError, match="acceptance_rate"):
        SimExecutor(acceptance_rate=[])


# ---------------------------------------------------------------------- Chrome trace
CHROME_PHASES = {"X", "i", "C", "M"}


def assert_valid_chrome_trace(data: dict) -> None:
    """The Trace Event Format's JSON object form, as Perfetto and chrome://tracing read it."""
    assert isinstance(data["traceEvents"], list) and data["traceEvents"]
    assert data.get("displayTimeUnit") in (None, "ms", "ns")
    spans: dict = {}
    for e in data["traceEvents"]:
        assert e["ph"] in CHROME_PHASES, e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index")
            assert set(e["args"]) <= {"name", "sort_index"}
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
            spans.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values())
        if e["ph"] == "i":
            assert e["s"] in ("g", "p", "t")
    for track in spans.values():  # complete events on one track never overlap (they nest or follow)
        track.sort()
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(track, track[1:]))


@pytest.mark.parametrize("policy", ["static", "chunked", "spec"])
def test_chrome_trace_is_valid(tmp_path, policy):
    reqs = make_trace(12, rate_per_s=20, max_prompt_len=64, max_output_len=16, output_scale=0.25, seed=5)
    ex = SimExecutor(acceptance_rate=0.5) if policy == "spec" else SimExecutor()
    kwargs = dict(max_num_seqs=4, n_slots=320, block_size=8) if policy != "static" else dict(batch_size=4)
    if policy == "chunked":
        kwargs["max_num_batched_tokens"] = 32
    engine = make_engine(policy, ex, SimClock(), **kwargs)
    engine.generate(reqs)
    path = write_chrome_trace(tmp_path / "t" / f"{policy}.json", engine.trace, reqs, policy)
    data = json.loads(path.read_text())
    assert_valid_chrome_trace(data)
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {r.request_id for r in reqs} <= names and "row 0" in names
    x = [e for e in data["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    assert len(x) == sum(len(r.entries) for r in engine.trace)  # every batch row of every step
    assert sum(e["name"] == "finished" for e in data["traceEvents"]) == len(reqs)
    kinds = {e["cat"] for e in x}
    assert {"static": "padding", "chunked": "chunk", "spec": "verify"}[policy] in kinds
    assert chrome_trace(engine.trace)["traceEvents"]  # requests are optional


# ---------------------------------------------------------------------- capacity at a latency bound
def test_capacity_interpolates_between_the_last_rate_under_the_bound_and_the_first_over():
    from minibatch.experiments.rate_sweep import capacity_at, capacity_is_lower_bound

    rows = [{"setup": "a", "rate": r, "normalized_latency_s": y} for r, y in ((2, 0.2), (1, 0.1), (4, 1.4), (3, 0.6))]
    # under the bound of 1.0 up to rate 3 (0.6), over it at rate 4 (1.4): 1.0 is halfway, at rate 3.5
    assert capacity_at(rows, "a", limit=1.0) == pytest.approx(3.5)
    assert capacity_at(rows, "a", limit=0.6) == pytest.approx(3.0)  # exactly at a swept rate
    assert capacity_at(rows, "a", limit=2.0) == 4  # never over: the highest swept rate, a lower bound
    assert capacity_at(rows, "a", limit=0.05) is None  # over at the lowest rate already
    assert capacity_is_lower_bound(rows, "a", limit=2.0) and not capacity_is_lower_bound(rows, "a", limit=1.0)
    assert not capacity_is_lower_bound(rows, "b", limit=2.0)  # no rate swept: no capacity, not a bound
    # a finer grid moves the estimate only as much as the curve bends between grid points
    coarse = [r for r in rows if r["rate"] in (1, 4)]
    assert capacity_at(coarse, "a", limit=1.0) == pytest.approx(1 + 3 * 0.9 / 1.3)


def test_capacity_figure_draws_the_bound_and_the_capacities():
    from minibatch.viz.simulation import plot_capacity

    rows = [{"setup": s, "rate": r, "normalized_latency_s": y * k}
            for s, k in (("orca", 1.0), ("static bs=8", 4.0)) for r, y in ((1, 0.1), (2, 0.3), (3, 2.0))]
    ax = plot_capacity(rows, limit=1.0, capacity={"orca": 2.4, "static bs=8": 1.6})
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:2] == ["orca: 2.4 req/s", "static bs=8: 1.6 req/s"] and labels[2] == "bound: 1 s/token"
    assert min(t.get_size() for t in ax.get_xticklabels() + ax.get_yticklabels()) >= 8
    matplotlib.pyplot.close(ax.figure)


# ---------------------------------------------------------------------- step-through widget
def test_step_figure_and_widget():
    from minibatch.viz.step_widget import num_blocks_of, step_figure, step_widget

    reqs = [Request(f"r{i}", [3] * (5 + 7 * i), 4 + i, GREEDY) for i in range(5)]
    engine = Engine(PagedScheduler(max_num_seqs=3, num_blocks=12, block_size=4), SimExecutor())
    engine.generate(reqs)
    assert num_blocks_of(engine.trace) <= 12
    fig = step_figure(engine.trace, 2, num_blocks=12)
    assert len(fig.axes) == 3 and "KV blocks" in fig.axes[1].get_title()
    assert fig.axes[0].patches  # bars of the batch composition
    with pytest.raises(IndexError, match="step"):
        step_figure(engine.trace, len(engine.trace))
    static = Engine(StaticScheduler(batch_size=2), SimExecutor())
    static.generate([r.copy() for r in reqs])
    fig = step_figure(static.trace, 1)  # no block tables: the map is replaced by a note
    assert "no paged KV cache" in fig.axes[1].texts[0].get_text()
    w = step_widget(engine.trace, num_blocks=12)
    assert w.slider.max == len(engine.trace) - 1
    w.slider.value = 3  # redraws without error
    with pytest.raises(ValueError, match="empty"):
        step_widget([])


def test_validate_policy_measures_and_simulates(tiny_profile):
    """minibatch.sim.validate on a tiny model: a measured run and its simulation, the replay of
    the measured steps (n-gram speculation's too), and for n-gram speculation the measured proposal and acceptance
    rates."""
    from minibatch.compare import CompareConfig, build_trace
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner
    from minibatch.sim.validate import METRICS, measure_policy, simulate_measured

    model, tok = load_model("tiny-random-llama")
    cfg = CompareConfig(model="tiny-random-llama", dtype="float32", num_requests=6, rate=50.0, max_prompt_len=24,
                        max_output_len=12,
                        check_reference=False, figures_dir=None, progress=False)
    requests = build_trace(cfg, None, model.config.vocab_size)
    profile = Profile.load(tiny_profile)
    for policy in ("chunked", "spec_ngram"):
        row = simulate_measured(measure_policy(policy, cfg, ModelRunner(model, tok), requests), cfg, requests, profile)
        assert set(row["error"]) == set(METRICS)
        assert row["measured"]["num_steps"] == len(row["steps"]) > 0
        assert all(len(s) == 6 and s[-1] > 0 for s in row["steps"])
        if policy == "chunked":
            assert np.isfinite(row["replay_error"])
            assert set(row["replay_error_by_kind"]) == {"prefill", "mixed", "decode"}
            assert set(row["error_at_measured_speed"]) == set(METRICS)
            mechanics = row["mechanics_error"]  # measured step times: the measured timeline, up to us rounding
            assert mechanics["diverged_at_step"] is None and abs(mechanics["ttft_p50_s"]) < 1e-3
        else:  # n-gram lookup: its target steps are replayed (no draft forwards to price); the schedule differs
            assert np.isfinite(row["replay_error"]) and 0 <= row["proposal_rate"] <= 1
            assert set(row["replay_error_by_kind"]) == {"prefill", "mixed", "decode"}
            assert row["error_at_measured_speed"] is None and row["mechanics_error"] is None


def test_measured_step_times_rebuild_the_wall_clock_timeline(one_thread):
    """Given each step's measured duration (MeasuredClock), the simulator (SimExecutor, no model)
    rebuilds a real WallClock run's timeline exactly, idle gaps and arrivals during a step
    included: both clocks stamp first tokens at the step's end, admit arrivals between steps and
    skip idle gaps with the same engine code, so every TTFT error of the simulator is a step-time
    error."""

    from minibatch.clock import WallClock
    from minibatch.compare import CompareConfig, build_trace, run_policies
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner
    from minibatch.sim.validate import STEP_FIELDS, MeasuredClock, simulate_row

    model, tok = load_model("tiny-random-llama")
    cfg = CompareConfig(model="tiny-random-llama", dtype="float32", num_requests=16, rate=400.0, max_prompt_len=48,
                        max_output_len=10, settings=dict(batch_size=4, max_wait_s=0.01), check_reference=False,
                        figures_dir=None,
                        progress=False)
    requests = build_trace(cfg, None, model.config.vocab_size)
    for r in requests[8:]:  # two bursts: arrivals during steps within each, an idle gap between them
        r.arrival_time_s += 1.0
    runner = ModelRunner(model, tok)
    idle = mid_step = 0
    for policy in ("static", "orca", "paged", "chunked"):
        real = run_policies(cfg, requests, runner, WallClock, policies=(policy,))[policy]
        trace = real.engine.trace
        idle += sum(b.start_s > a.end_s for a, b in zip(trace, trace[1:]))
        mid_step += sum(s.start_s < r.arrival_time_s < s.end_s for s in trace for r in real.requests)
        steps = [[getattr(StepShape.of(s), f) for f in STEP_FIELDS[:-1]] + [s.duration_s * 1e6] for s in trace]
        clock = MeasuredClock(steps, padded=trace[0].layout == "padded")
        sim = simulate_row({"policy": policy}, cfg, requests, lambda: clock)
        assert clock.diverged_at is None and len(sim.engine.trace) == len(trace)
        for a, b in zip(real.requests, sim.requests):
            assert b.token_times_s == pytest.approx(a.token_times_s, abs=1e-9)
            assert b.first_scheduled_time_s == pytest.approx(a.first_scheduled_time_s, abs=1e-9)
    assert idle > 0 and mid_step > 0  # the workload has both cases


def test_step_kind_replay_by_kind_and_scaled_cost(tiny_profile):
    """Stored steps split into prefill / mixed / decode; ScaledCost multiplies both step and
    draft-forward times; a replay by kind prices each kind's steps against their measured sum."""
    from minibatch.sim.validate import ScaledCost, replay_by_kind, step_kind

    profile = Profile.load(tiny_profile)
    steps = [[40, 1, 1, 1600, 0, 0], [43, 4, 1, 1600, 3 * 50, 0], [3, 3, 0, 0, 3 * 50, 0], [8, 2, 0, 64, 0, 0]]
    assert [step_kind(s) for s in steps] == ["prefill", "mixed", "decode", "prefill"]  # last: a padded prefill
    for s, t in zip(steps[:3], profile.predict([StepShape(*s[:-1]) for s in steps[:3]])):
        s[-1] = round(t * 1e6 * 1.25)  # measured 25% slower than priced
    kinds = replay_by_kind({"padded": False, "steps": steps[:3]}, profile)
    assert kinds == pytest.approx({"prefill": 1 / 1.25 - 1, "mixed": 1 / 1.25 - 1, "decode": 1 / 1.25 - 1}, abs=2e-3)
    assert replay_by_kind({"padded": False, "steps": steps[2:3]}, profile)["mixed"] is None
    scaled, shape = ScaledCost(profile, 2.0), StepShape(*steps[1][:-1])
    assert scaled.step_time_s(shape) == pytest.approx(2 * profile.step_time_s(shape))
    assert scaled.forward_time_s(2, 2, 30) == pytest.approx(2 * profile.forward_time_s(2, 2, 30))


def test_make_engine_leaves_the_simulated_executor_as_it_found_it():
    """A speculative policy runs on a copy of the SimExecutor with its speculator: a later non-speculative policy
    on the same executor verifies no drafts (it used to inherit the speculator make_engine had attached)."""
    ex = SimExecutor(acceptance_rate=0.8, seed=0)
    trace = make_trace(6, rate_per_s=10.0, max_prompt_len=32, max_output_len=16, seed=0)
    spec = make_engine("spec", ex, SimClock(), n_slots=2048, num_speculative_tokens=3)
    spec.generate([r.copy() for r in trace])
    assert any(e.num_spec_tokens for r in spec.trace for e in r.entries)  # drafts were verified
    assert ex.speculator is None
    paged = make_engine("paged", ex, SimClock(), n_slots=2048)
    paged.generate([r.copy() for r in trace])
    assert not any(e.num_spec_tokens for r in paged.trace for e in r.entries)


def test_validate_sim_resimulates_the_committed_measurements(tmp_path):
    """``benchmarks/validate_sim.py --resimulate`` (no model: the committed measured runs on a profile) runs and
    reports an error per policy and trace; it broke silently once when CompareConfig's options moved."""
    from benchmark_scripts import load_benchmark

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "v.json"
    load_benchmark("validate_sim").main(["--dtype", "bfloat16", "--resimulate", "--profile",
                                         str(root / "data/profiles/smollm2-135m-cpu-bfloat16.json"), "--measured",
                                         str(root / "data/cpu/sim_validation_bfloat16_measured.json"), "--json",
                                         str(out)])
    result = json.loads(out.read_text())
    rows = [r for t in result["traces"].values() for r in t["policies"]]
    assert len(rows) == 10 and all(np.isfinite(r["error"]["output_throughput_tok_s"]) for r in rows)


def test_made_up_tokens_respect_min_tokens():
    """Before min_tokens, a SimExecutor's made-up token is never EOS or a stop id (they are banned, as the model
    runner bans them); the request still stops at the first stop id after it."""
    from minibatch import Request, SamplingParams, SimClock, make_engine
    from minibatch.sim.executor import SimExecutor

    r = Request("r", [1, 2, 3], 30, SamplingParams(ignore_eos=True, stop_token_ids=[3, 4, 5], min_tokens=20))
    make_engine("paged", SimExecutor(vocab_size=8), SimClock(), n_slots=256).generate([r])
    assert not set(r.output_token_ids[:20]) & {3, 4, 5}
    assert 20 < r.num_output_tokens <= 30 and r.output_token_ids[-1] in (3, 4, 5)
