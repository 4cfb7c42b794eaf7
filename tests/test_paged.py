"""Paged KV through the engine: token-exact against HF generate (torch and triton backends, prefix
caching on and off, preemption by recompute and by swap), copy-on-write parallel sampling, and
the scheduler's promises (no request lost or duplicated, admission by free blocks)."""

import pytest
import torch

from minibatch import (ModelRunner, OrcaScheduler, PagedScheduler, Request, SamplingParams, SimClock, SimExecutor,
                       make_engine)
from minibatch.reference import reference_outputs
from minibatch.engine import Engine
from minibatch.models import load_model
from minibatch.request import RequestStatus, fork_requests

GREEDY = SamplingParams(ignore_eos=True)
MAX_NEW = [8, 3, 12, 6, 10, 5, 9, 20]  # as conftest's paged_setup


@pytest.fixture(scope="module")
def setup(paged_setup):
    return paged_setup


def make_requests(prompts, sampling=GREEDY, gap_s=0.01):
    return [Request(f"r{i}", p, n, sampling, arrival_time_s=gap_s * i)
            for i, (p, n) in enumerate(zip(prompts, MAX_NEW))]


def run(runner, prompts, policy="paged", gap_s=0.01, **kwargs):
    reqs = make_requests(prompts, gap_s=gap_s)
    engine = make_engine(policy, runner, SimClock(), **{"max_num_seqs": 8, **kwargs})
    engine.generate(reqs)
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not bm.cpu_block_tables  # everything given back
    return reqs, engine


@pytest.mark.parametrize("policy", ["paged", "paged_prefix"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_matches_hf_generate(setup, policy, block_size):
    _, runner, prompts, refs = setup
    reqs, _ = run(runner, prompts, policy, n_slots=1024, block_size=block_size)
    assert {r.request_id: r.output_token_ids for r in reqs} == refs


@pytest.mark.parametrize("policy", ["paged", "paged_prefix"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_matches_under_preemption(setup, policy, mode):
    _, runner, prompts, refs = setup
    reqs, engine = run(runner, prompts, policy, n_slots=80, block_size=4, preemption_mode=mode)
    assert engine.scheduler.num_preemptions > 0
    assert sum(len(s.preempted) for s in engine.trace) == engine.scheduler.num_preemptions
    if mode == "swap":
        assert any(s.preempted for s in engine.trace)
    assert {r.request_id: r.output_token_ids for r in reqs} == refs


@pytest.mark.parametrize("policy,mode,n_slots", [("paged", "recompute", 1024), ("paged_prefix", "swap", 80)])
def test_triton_backend_matches(setup, policy, mode, n_slots):
    model, _, prompts, refs = setup
    runner = ModelRunner(model, attention_backend="triton")
    reqs, engine = run(runner, prompts, policy, n_slots=n_slots, block_size=4, preemption_mode=mode)
    assert {r.request_id: r.output_token_ids for r in reqs} == refs
    assert n_slots > 100 or engine.scheduler.num_preemptions > 0


def test_prefix_caching_hits_the_shared_system_prompt(setup):
    _, runner, prompts, refs = setup
    reqs, engine = run(runner, prompts, "paged_prefix", gap_s=1.0, n_slots=1024, block_size=4)
    assert {r.request_id: r.output_token_ids for r in reqs} == refs
    bm = engine.scheduler.block_manager
    # r1, r3, r5, r7 share a 19-token system prompt: 4 full blocks of 4. Arriving 1 s apart
    # (after r1 finished), r3, r5 and r7 find them cached and skip 16 prompt tokens each.
    assert bm.num_prefix_hit_tokens == 3 * 16
    assert bm.num_prefix_query_tokens == sum(map(len, prompts))
    prefill = {e.request_id: e.num_new_tokens for s in engine.trace for e in s.entries if e.phase == "prefill"}
    assert prefill["r1"] == len(prompts[1]) and prefill["r3"] == len(prompts[3]) - 16
    # the same trace without prefix caching: r3's prefill computes 16 more tokens, so its TTFT is longer
    plain, _ = run(runner, prompts, "paged", gap_s=1.0, n_slots=1024, block_size=4)
    ttft = {r.request_id: r.first_token_time_s - r.arrival_time_s for r in reqs}
    ttft_plain = {r.request_id: r.first_token_time_s - r.arrival_time_s for r in plain}
    assert all(ttft[f"r{i}"] < ttft_plain[f"r{i}"] for i in (3, 5, 7))


def test_fork_copy_on_write_greedy_and_memory(setup):
    model, runner, prompts, _ = setup
    prompt = prompts[3]  # 49 tokens
    parent = Request("p", prompt, 6, GREEDY)
    group = fork_requests(parent, 4)
    ref = reference_outputs(model, [Request("x", prompt, 6, GREEDY)])["x"]
    engine = make_engine("paged", runner, SimClock(), max_num_seqs=8, n_slots=1024, block_size=4)
    engine.generate(group)
    assert all(r.output_token_ids == ref for r in group)
    peak_shared = max(s.num_kv_slots_reserved for s in engine.trace)
    copies = [r.copy() for r in group]
    for r in copies:
        r.parent_request_id = None
    engine = make_engine("paged", runner, SimClock(), max_num_seqs=8, n_slots=1024, block_size=4)
    engine.generate(copies)
    peak_alone = max(s.num_kv_slots_reserved for s in engine.trace)
    # 3 children share the parent's 12 full prompt blocks (the 13th, partial, is copied on write)
    assert peak_alone - peak_shared >= 3 * 12 * 4


def test_fork_sampling_equals_independent_requests(setup):
    """Copy-on-write must not leak one sample's KV into another: forked children produce exactly
    the tokens of the same requests (same seeds) run without sharing."""
    _, runner, prompts, _ = setup
    sampling = SamplingParams(temperature=1.0, seed=5, ignore_eos=True)
    group = fork_requests(Request("p", prompts[1], 12, sampling), 3)
    make_engine("paged", runner, SimClock(), max_num_seqs=8, n_slots=1024, block_size=4).generate(group)
    alone = [r.copy() for r in group]
    for r in alone:
        r.parent_request_id = None
        make_engine("paged", runner, SimClock(), max_num_seqs=8, n_slots=1024, block_size=4).generate([r])
    assert [r.output_token_ids for r in group] == [r.output_token_ids for r in alone]
    assert len({tuple(r.output_token_ids) for r in group}) > 1  # the samples really differ


# ------------------------------------------------------------------ scheduler behaviour (no model)
def sim_requests(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Request(f"q{i}", [1] * int(torch.randint(1, 60, (1,), generator=g)),
                int(torch.randint(1, 80, (1,), generator=g)), GREEDY, arrival_time_s=0.005 * i)
        for i in range(n)
    ]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_no_request_lost_or_duplicated_under_pressure(mode):
    reqs = sim_requests()
    sched = PagedScheduler(max_num_seqs=16, num_blocks=24, block_size=8, preemption_mode=mode, num_cpu_blocks=10)
    engine = Engine(sched, SimExecutor(), SimClock())
    for r in reqs:
        engine.add_request(r)
    seen_finished = []
    while engine.has_unfinished():
        record = engine.step()
        queues = [r.request_id for q in (sched.waiting, sched.running, sched.swapped) for r in q]
        assert len(queues) == len(set(queues))  # never in two places at once
        sched.block_manager.check_invariants()
        if record:
            assert record.num_kv_slots_reserved <= 24 * 8
            seen_finished += record.finished
    assert sorted(seen_finished) == sorted(r.request_id for r in reqs)
    assert all(r.num_output_tokens == r.max_new_tokens and r.status == RequestStatus.FINISHED for r in reqs)
    assert sched.num_preemptions > 0


def test_paged_admits_more_than_orca_in_the_same_memory():
    def peak_running(scheduler):
        engine = Engine(scheduler, SimExecutor(), SimClock())
        engine.generate(sim_requests(seed=1))
        return max(s.num_running for s in engine.trace), engine.trace

    orca_peak, orca_trace = peak_running(OrcaScheduler(max_num_seqs=64, n_slots=512, block_size=8))
    paged_peak, paged_trace = peak_running(PagedScheduler(max_num_seqs=64, num_blocks=64, block_size=8))
    assert paged_peak > orca_peak
    from minibatch.records import kv_waste_fraction

    assert kv_waste_fraction(paged_trace) < 0.2 < kv_waste_fraction(orca_trace)


def test_internal_fragmentation_is_below_one_block_per_request():
    engine = Engine(PagedScheduler(max_num_seqs=64, num_blocks=4096, block_size=16), SimExecutor(), SimClock())
    engine.generate(sim_requests())
    for s in engine.trace:
        assert 0 <= s.num_kv_slots_reserved - s.num_kv_slots_used <= 15 * s.num_running


def test_bad_input_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="preemption_mode"):
        PagedScheduler(preemption_mode="drop")
    with pytest.raises(ValueError, match="max_num_seqs"):
        PagedScheduler(max_num_seqs=0)
    engine = Engine(PagedScheduler(num_blocks=4, block_size=4, watermark=0.0), SimExecutor(), SimClock())
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(Request("big", [1] * 10, 7))  # 17 tokens need 5 blocks of 4
    with pytest.raises(ValueError, match="attention_backend"):
        ModelRunner(load_model("tiny-random-llama")[0], attention_backend="cuda")
