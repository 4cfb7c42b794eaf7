"""The engine under static and Orca scheduling: token-exact against HF generate, and the
iteration-level behaviour the Orca paper describes."""

import pytest
import torch

from minibatch import (
    Engine, ModelRunner, OrcaScheduler, Request, SamplingParams, SimClock, SimExecutor, StaticScheduler,
    make_engine,
)
from minibatch.models import load_model

GREEDY = SamplingParams(ignore_eos=True)
PROMPT_LENS = [5, 17, 9, 30, 3, 12, 21]
MAX_NEW = [8, 3, 12, 6, 10, 5, 9]


def hf_reference(model, prompt, max_new_tokens):
    """HF generate on one request alone, greedy, no EOS stop."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["tiny-random-llama", "tiny-random-gpt2"])
def setup(request):
    model, tok = load_model(request.param)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    refs = [hf_reference(model, p, n) for p, n in zip(prompts, MAX_NEW)]
    return ModelRunner(model, tok), prompts, refs


def make_requests(prompts, arrival_gap_s=0.02, sampling=GREEDY):
    return [
        Request(f"r{i}", p, n, sampling, arrival_time_s=arrival_gap_s * i)
        for i, (p, n) in enumerate(zip(prompts, MAX_NEW))
    ]


@pytest.mark.parametrize("policy", ["static", "orca"])
@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_greedy_matches_hf_generate(setup, policy, max_num_seqs):
    runner, prompts, refs = setup
    reqs = make_requests(prompts)
    engine = make_engine(policy, runner, SimClock(),
                         config={"batch_size": max_num_seqs, "max_num_seqs": max_num_seqs, "n_slots": 128})
    engine.generate(reqs)
    for r, ref in zip(reqs, refs):
        assert r.output_token_ids == ref, r.request_id
        assert r.finish_reason == "length"


def test_orca_with_blocks_matches(setup):
    runner, prompts, refs = setup
    reqs = make_requests(prompts)
    make_engine("orca", runner, SimClock(), max_num_seqs=4, n_slots=256, block_size=16).generate(reqs)
    assert [r.output_token_ids for r in reqs] == refs


def test_concurrent_requests_decode_in_the_same_steps(setup):
    """Phase 12: 3 concurrent requests produce tokens in the same steps, not one after another."""
    runner, prompts, _ = setup
    reqs = [Request(f"c{i}", prompts[i], 6, GREEDY) for i in range(3)]
    engine = make_engine("orca", runner, SimClock(), max_num_seqs=8)
    engine.generate(reqs)
    assert len(engine.trace) == 6  # one prefill step (all three micro-batched) + 5 decode steps
    assert reqs[0].token_times_s == reqs[1].token_times_s == reqs[2].token_times_s
    assert all(len(rec.entries) == 3 for rec in engine.trace)


def test_late_arrival_joins_mid_generation(setup):
    """Phase 12: a request arriving mid-generation starts before the running one ends (Orca),
    but waits for the whole batch under static batching."""
    runner, prompts, _ = setup
    for policy, joins in [("orca", True), ("static", False)]:
        long = Request("long", prompts[0], 20, GREEDY, arrival_time_s=0.0)
        late = Request("late", prompts[1], 3, GREEDY, arrival_time_s=0.1)
        engine = make_engine(policy, runner, SimClock(), config={"batch_size": 4, "max_num_seqs": 4, "max_wait_s": 0.0})
        engine.generate([long, late])
        assert (late.first_scheduled_time_s < long.finish_time_s) is joins, policy
        assert late.first_scheduled_time_s >= late.arrival_time_s


def test_concurrent_outputs_equal_single_outputs(setup):
    runner, prompts, _ = setup
    alone = []
    for i in range(3):
        r = Request(f"s{i}", prompts[i], 7, GREEDY)
        make_engine("orca", runner, SimClock()).generate([r])
        alone.append(r.output_token_ids)
    together = [Request(f"s{i}", prompts[i], 7, GREEDY) for i in range(3)]
    make_engine("orca", runner, SimClock()).generate(together)
    assert [r.output_token_ids for r in together] == alone


def test_sampling_is_seeded_per_request(setup):
    runner, prompts, _ = setup
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=123)
    one = Request("x", prompts[2], 10, sp)
    make_engine("orca", runner, SimClock()).generate([one])
    batch = make_requests(prompts, sampling=sp)
    batch[2] = Request("x", prompts[2], 10, sp, arrival_time_s=0.04)
    make_engine("orca", runner, SimClock(), max_num_seqs=8).generate(batch)
    assert batch[2].output_token_ids == one.output_token_ids


def test_eos_finishes_with_stop(setup):
    runner, prompts, refs = setup
    saved = runner.eos_token_ids
    runner.eos_token_ids = (refs[0][2],)  # make the third greedy token an EOS
    try:
        r = Request("e", prompts[0], MAX_NEW[0], SamplingParams())
        make_engine("orca", runner, SimClock()).generate([r])
    finally:
        runner.eos_token_ids = saved
    assert r.finish_reason == "stop"
    assert r.output_token_ids == refs[0][: refs[0].index(refs[0][2]) + 1]


def test_stream_yields_every_token_in_order(setup):
    runner, prompts, _ = setup
    reqs = make_requests(prompts)
    engine = make_engine("orca", runner, SimClock(), max_num_seqs=3)
    events = list(engine.stream(reqs))
    for r in reqs:
        mine = [e for e in events if e.request_id == r.request_id]
        assert [e.token_id for e in mine] == r.output_token_ids
        assert [e.time_s for e in mine] == r.token_times_s
        assert mine[-1].is_finished and not any(e.is_finished for e in mine[:-1])


# ---------------------------------------------------------------- pure-scheduler invariants


def sim_requests(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(1, 40, (1,), generator=g))
        m = int(torch.randint(1, 30, (1,), generator=g))
        t = float(torch.rand(1, generator=g)) * 2.0
        out.append(Request(f"q{i:02d}", [5] * p, m, GREEDY, arrival_time_s=t))
    return out


def test_orca_invariants():
    reqs = sim_requests()
    sched = OrcaScheduler(max_num_seqs=5, n_slots=120)
    engine = Engine(sched, SimExecutor(), SimClock())
    engine.generate(reqs)
    by_id = {r.request_id: r for r in reqs}
    admitted_order = []
    for rec in engine.trace:
        assert len(rec.entries) <= 5
        assert rec.num_kv_slots_reserved <= 120
        slots = [e.row for e in rec.entries]
        assert len(set(slots)) == len(slots)
        for e in rec.entries:
            assert rec.start_s >= by_id[e.request_id].arrival_time_s  # never before arrival
            if e.phase == "prefill":
                admitted_order.append(e.request_id)
    assert admitted_order == sorted(admitted_order, key=lambda i: (by_id[i].arrival_time_s, i))  # FCFS
    assert all(r.num_output_tokens == r.max_new_tokens for r in reqs)
    assert sched.n_rsrv == 0 and sched.block_manager.num_free_blocks == 120


def test_static_batches_are_closed():
    """Nobody joins mid-batch: between two prefill steps the batch membership never changes."""
    reqs = sim_requests()
    engine = Engine(StaticScheduler(batch_size=4, max_wait_s=0.3), SimExecutor(), SimClock())
    engine.generate(reqs)
    members = None
    for rec in engine.trace:
        ids = {e.request_id for e in rec.entries}
        if rec.entries[0].phase == "prefill":
            members = ids
            assert len(ids) <= 4
        assert ids == members
        assert rec.num_idle_rows == 4 - len(ids)
    assert all(r.num_output_tokens == r.max_new_tokens for r in reqs)


def test_static_serves_by_arrival_time_and_a_late_added_old_request_does_not_wait_again():
    """The partial batch's timer is the oldest arrival's, and the batch takes the earliest arrivals: a request added
    mid-run with an arrival time long past starts the batch at once (it used to wait for the first one handed in)."""
    engine = make_engine("static", SimExecutor(), SimClock(), batch_size=4, max_wait_s=1.0)
    for rid, t in (("b", 3.0), ("c", 3.5)):
        engine.add_request(Request(rid, [5] * 4, 2, GREEDY, arrival_time_s=t))
    while engine.clock.now_s < 3.5:
        engine.step()  # b waits for a fuller batch (until 4.0 by its own arrival)
    engine.add_request(Request("old", [5] * 4, 2, GREEDY, arrival_time_s=0.5))  # waiting since 0.5
    engine.generate([])
    assert [engine.requests[r].first_scheduled_time_s for r in ("old", "b", "c")] == pytest.approx([3.5] * 3)
    assert [r.request_id for r in engine.scheduler.batch] == ["old", "b", "c"]


def test_sim_clock_is_deterministic():
    def run():
        reqs = sim_requests()
        e = make_engine("orca", SimExecutor(), SimClock(), max_num_seqs=4, n_slots=200)
        e.generate(reqs)
        return [(r.token_times_s, r.finish_time_s) for r in reqs]

    assert run() == run()


def test_bad_input_is_rejected_with_a_clear_error():
    engine = make_engine("orca", SimExecutor(), SimClock(), n_slots=50)
    with pytest.raises(ValueError, match="n_slots"):
        engine.add_request(Request("big", [1] * 40, 20, GREEDY))
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request("bad", [1], 0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="policy"):
        make_engine("fancy", SimExecutor())
    with pytest.raises(ValueError, match="already added"):
        engine.add_request(Request("a", [1], 1))
        engine.add_request(Request("a", [1], 1))


def test_orca_max_reservation_reserves_the_cap():
    """reserve_new_tokens: vLLM's "Orca (Max)": prompt + the cap, whatever the request's own length."""
    sched = OrcaScheduler(max_num_seqs=8, n_slots=100, reserve_new_tokens=40)
    engine = Engine(sched, SimExecutor(), SimClock())
    reqs = [Request(f"r{i}", [1] * 10, 5, GREEDY) for i in range(3)]
    for r in reqs:
        engine.add_request(r)
    record = engine.step()
    assert sched.n_rsrv == 2 * 50 and record.num_running == 2  # a third 50-slot reservation does not fit
    engine.generate([])
    assert all(r.num_output_tokens == 5 for r in reqs)
    with pytest.raises(ValueError, match="reserve_new_tokens"):
        OrcaScheduler(reserve_new_tokens=0)



@pytest.mark.parametrize("policy", ["static", "orca", "paged", "chunked", "spec_ngram"])
def test_the_executor_receives_a_frozen_plan(policy):
    """The step contract: once schedule() returns, the engine freezes the plan, so an executor (or
    anyone after it) cannot patch it; what it reports goes into its StepResult."""
    import dataclasses

    from minibatch.experiment import run

    class Probe(SimExecutor):
        def execute(self, plan):
            for change in (lambda: setattr(plan, "layout", "x"), lambda: plan.scheduled.append(None),
                           lambda: plan.block_tables.__setitem__("r0", [0])):
                with pytest.raises((dataclasses.FrozenInstanceError, AttributeError, TypeError)):
                    change()
            self.num_plans = getattr(self, "num_plans", 0) + 1
            return super().execute(plan)

    probe = Probe(acceptance_rate=0.5)
    reqs = [Request(f"r{i}", [1, 2, 3, 4], 5, SamplingParams(ignore_eos=True)) for i in range(3)]
    result = run(policy, reqs, probe, config={"n_slots": 256})
    assert result.engine.executor.num_plans == len(result.records) > 0  # spec: a copy of probe, with its speculator
    assert all(r.num_output_tokens == 5 for r in result.requests)


def test_run_row_selects_fields_in_order_and_adds_an_experiments_columns():
    from minibatch.experiment import run

    reqs = [Request(f"r{i}", [1, 2, 3, 4], 3 + i, SamplingParams(ignore_eos=True)) for i in range(3)]
    result = run("paged", reqs, SimExecutor(), n_slots=256)
    full = result.row()
    assert full["policy"] == "paged" and full["num_requests"] == 3 and full["total_output_tokens"] == 3 + 4 + 5
    row = result.row("num_steps", "policy", "mine", policy="paged (16-token blocks)", mine=7)
    assert list(row) == ["num_steps", "policy", "mine"]
    assert row == {"num_steps": full["num_steps"], "policy": "paged (16-token blocks)", "mine": 7}
    with pytest.raises(ValueError, match="row field 'nope'"):
        result.row("nope")
