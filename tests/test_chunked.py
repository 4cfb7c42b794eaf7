"""Chunked prefill (Sarathi-Serve) and prefill-first: token-exact against HF generate for budgets
1, 7, 16, 64 with prefix caching on and off and under preemption; the schedules' promises (the
budget is never exceeded, decodes never stall behind a prefill, prefill-first steps are pure);
the adaptive chunker's fit and budget."""

import math

import pytest

from minibatch import Engine, ModelRunner, Request, SamplingParams, SimClock, SimExecutor, make_engine
from minibatch.scheduler import AdaptiveChunker, ChunkedPrefillScheduler, PrefillFirstScheduler
from minibatch.clock import CostModel

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(ignore_eos=True)
MAX_NEW = [8, 3, 12, 6, 10, 5, 9, 20]  # as conftest's paged_setup


@pytest.fixture(scope="module")
def setup(paged_setup):
    _, runner, prompts, refs = paged_setup
    return runner, prompts, refs


def make_requests(prompts, gap_s=0.01):
    return [Request(f"r{i}", p, n, GREEDY, arrival_time_s=gap_s * i) for i, (p, n) in enumerate(zip(prompts, MAX_NEW))]


def run(executor, prompts, policy, gap_s=0.01, **kwargs):
    reqs = make_requests(prompts, gap_s)
    engine = make_engine(policy, executor, SimClock(), **{"max_num_seqs": 8, **kwargs})
    engine.generate(reqs)
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not bm.cpu_block_tables  # everything given back
    assert all(r.is_finished and r.num_output_tokens == r.max_new_tokens for r in reqs)
    return reqs, engine


def outputs(reqs):
    return {r.request_id: r.output_token_ids for r in reqs}


@pytest.mark.parametrize("policy", ["chunked", "chunked_prefix"])
@pytest.mark.parametrize("budget", [1, 7, 16, 64])
def test_greedy_matches_hf_generate(setup, policy, budget):
    runner, prompts, refs = setup
    reqs, engine = run(runner, prompts, policy, n_slots=1024, block_size=4, max_num_batched_tokens=budget)
    assert outputs(reqs) == refs
    assert max(rec.num_scheduled_tokens for rec in engine.trace) <= budget
    if budget < max(len(p) for p in prompts):  # some prompt really was split across steps
        assert any(e.phase == "prefill" and e.num_computed_tokens > 0 for rec in engine.trace for e in rec.entries)


@pytest.mark.parametrize("policy", ["chunked", "chunked_prefix"])
@pytest.mark.parametrize("budget", [1, 7, 16, 64])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_matches_under_preemption(setup, policy, budget, mode):
    runner, prompts, refs = setup
    reqs, engine = run(runner, prompts, policy, n_slots=80, block_size=4, max_num_batched_tokens=budget,
                       preemption_mode=mode, gap_s=0.0)
    if budget == 1:  # one token per step: one request runs at a time, so nothing is ever preempted
        assert max(rec.num_running for rec in engine.trace) == 1
    else:
        assert engine.scheduler.num_preemptions > 0
    assert outputs(reqs) == refs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prefill_first_matches_and_steps_are_pure(setup, mode):
    runner, prompts, refs = setup
    for n_slots in (1024, 80):
        reqs, engine = run(runner, prompts, "prefill_first", n_slots=n_slots, block_size=4, preemption_mode=mode)
        assert outputs(reqs) == refs
        for rec in engine.trace:  # a step is all prefill or all decode
            assert len({e.phase for e in rec.entries}) == 1
    assert engine.scheduler.num_preemptions > 0


def test_triton_backend_chunked(setup):
    runner, prompts, refs = setup
    triton_runner = ModelRunner(runner.model, attention_backend="triton")
    reqs, _ = run(triton_runner, prompts, "chunked_prefix", n_slots=1024, block_size=4, max_num_batched_tokens=7)
    assert outputs(reqs) == refs


# ---------------------------------------------------------------- schedule invariants (no model)
def long_prompt_trace(n_short=6, long_len=300, short_len=20, out_len=30):
    reqs = [Request(f"s{i}", [5] * short_len, out_len, GREEDY, arrival_time_s=0.0) for i in range(n_short)]
    reqs.append(Request("long", [7] * long_len, 4, GREEDY, arrival_time_s=0.5))
    return reqs


def test_chunked_decodes_never_stall_and_budget_is_split():
    budget = 64
    engine = make_engine("chunked", SimExecutor(), SimClock(), max_num_seqs=16, n_slots=4096,
                         max_num_batched_tokens=budget)
    engine.generate(long_prompt_trace())
    long_steps = 0
    for rec in engine.trace:
        assert rec.num_scheduled_tokens <= budget
        running_decodes = [e for e in rec.entries if e.phase == "decode"]
        chunk = [e for e in rec.entries if e.request_id == "long" and e.phase == "prefill"]
        if chunk:
            long_steps += 1
            # stall-free: every short request still generating decodes in the same step
            active = {f"s{i}" for i in range(6)} - {r for prev in engine.trace[:rec.step] for r in prev.finished}
            assert {e.request_id for e in running_decodes} == active
            assert chunk[0].num_new_tokens == min(budget - len(running_decodes), 300 - chunk[0].num_computed_tokens)
    assert long_steps >= math.ceil(300 / budget)  # the 300-token prompt took several steps


def test_prefill_first_stalls_decodes_chunked_does_not():
    """On the simulated clock: the long prompt's prefill step is one long ITL for every decode
    under prefill-first; chunking bounds it by the budget's step time."""
    cost = CostModel()
    results = {}
    for policy, budget in (("prefill_first", None), ("chunked", 64)):
        engine = make_engine(policy, SimExecutor(), SimClock(cost), max_num_seqs=16, n_slots=4096,
                             max_num_batched_tokens=budget)
        reqs = engine.generate(long_prompt_trace())
        results[policy] = max(b - a for r in reqs for a, b in zip(r.token_times_s, r.token_times_s[1:]))
    stall = cost.fixed_s + cost.per_seq_s + (cost.per_token_s + cost.per_context_token_s) * 300  # about 0.48 s
    assert results["prefill_first"] >= stall * 0.99
    assert results["chunked"] < stall / 3


def test_budget_must_fit_whole_requests_without_chunking():
    # the budget is chunked prefill's setting; a scheduler built by hand may still take one without chunking
    engine = Engine(PrefillFirstScheduler(num_blocks=256, max_num_batched_tokens=100), SimExecutor(), SimClock())
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.add_request(Request("big", [3] * 90, 20, GREEDY))
    make_engine("chunked", SimExecutor(), SimClock(), n_slots=4096, max_num_batched_tokens=1).add_request(
        Request("big", [3] * 90, 20, GREEDY))  # chunking: any budget >= 1 works


@pytest.mark.parametrize("kwargs,field", [({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
                                          ({"max_num_batched_tokens": -5}, "max_num_batched_tokens")])
def test_bad_budget_is_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ChunkedPrefillScheduler(**kwargs)
    with pytest.raises(ValueError, match=field):
        PrefillFirstScheduler(**kwargs)


def test_target_itl_needs_chunked():
    with pytest.raises(ValueError, match="target_itl_s"):
        make_engine("paged", SimExecutor(), SimClock(), target_itl_s=0.1)


# ---------------------------------------------------------------- adaptive chunk size
def test_adaptive_chunker_fits_the_clock_and_meets_the_target():
    """On a SimClock whose cost is exactly linear in prefill and decode tokens, the fit recovers
    the coefficients and every step with a prefill chunk stays within the target."""
    cost = CostModel(fixed_s=0.02, per_seq_s=0.0, per_token_s=0.001, per_context_token_s=0.0)
    chunker = AdaptiveChunker(target_itl_s=0.1, prior=(0.05, 0.004, 0.004), min_chunk=4)
    sched = ChunkedPrefillScheduler(max_num_seqs=16, num_blocks=512, block_size=16, chunker=chunker)
    from minibatch.engine import Engine
    engine = Engine(sched, SimExecutor(), SimClock(cost))
    reqs = long_prompt_trace(long_len=2000) + [Request("long2", [9] * 1500, 4, GREEDY, arrival_time_s=3.0)]
    engine.generate(reqs)
    assert chunker.num_fits > 0
    assert chunker.coefficients == pytest.approx((0.02, 0.001, 0.001), rel=1e-6, abs=1e-9)
    late = [rec for rec in engine.trace[40:] if rec.num_prefill_tokens]
    assert late and all(rec.duration_s <= 0.1 + 1e-9 for rec in late)
    assert max(rec.duration_s for rec in late) > 0.09  # and it uses the room: chunks fill the target


def test_adaptive_chunker_arguments():
    with pytest.raises(ValueError, match="target_itl_s"):
        AdaptiveChunker(0.0)
    with pytest.raises(ValueError, match="min_chunk"):
        AdaptiveChunker(0.1, min_chunk=0)
    with pytest.raises(ValueError, match="prior"):
        AdaptiveChunker(0.1, prior=(0.0, 0.0, 0.0))
    chunker = AdaptiveChunker(0.1, prior=(0.02, 0.001, 0.002), min_chunk=8, max_chunk=50)
    assert chunker.token_budget(0) == 50  # (0.1 - 0.02) / 0.001 = 80, capped at 50
    assert chunker.token_budget(10) == 10 + 50  # 60 room, capped
    assert chunker.token_budget(35) == 35 + 10  # (0.1 - 0.02 - 0.07) / 0.001 = 10
    assert chunker.token_budget(100) == 100 + 8  # no room: min_chunk keeps prefills moving
