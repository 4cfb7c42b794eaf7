"""Engine.abort_request: a request stopped in any state (not yet arrived, waiting, running, swapped)
gives back its KV at once, finishes with finish_reason "abort", and leaves every other request's
outputs as they would have been."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import MAX_NEW
from minibatch.clock import SimClock
from minibatch.policies import POLICIES, make_engine
from minibatch.request import Request, RequestStatus, SamplingParams
from minibatch.sim.executor import SimExecutor

GREEDY = SamplingParams(ignore_eos=True)


def sim_requests(n=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Request(f"q{i}", [3] * int(torch.randint(1, 50, (1,), generator=g)),
                    int(torch.randint(1, 40, (1,), generator=g)), GREEDY, arrival_time_s=0.01 * i) for i in range(n)]


def kv_in_use(scheduler) -> int:
    bm = getattr(scheduler, "block_manager", None)
    if bm is None:
        return 0
    return bm.num_used_blocks + len(bm.cpu_block_tables)


@settings(max_examples=25, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)), mode=st.sampled_from(["recompute", "swap"]),
       aborts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 13)), max_size=6))
def test_aborts_in_any_state_free_kv_and_lose_no_request(policy, mode, aborts):
    reqs = sim_requests()
    options = {"preemption_mode": mode} if "preemption_mode" in POLICIES[policy].options else {}
    engine = make_engine(policy, SimExecutor(acceptance_rate=0.7), SimClock(),
                         config={"n_slots": 160, "max_num_seqs": 6, "batch_size": 6}, **options)
    for r in reqs:
        engine.add_request(r)
    bm = getattr(engine.scheduler, "block_manager", None)
    if bm is not None and mode == "swap":
        bm.num_cpu_blocks = 64  # room to swap out
    states, aborted, step = set(), set(), 0
    while engine.has_unfinished():
        for at, i in aborts:
            if at == step and not reqs[i].is_finished:
                states.add(reqs[i].status)
                assert engine.abort_request(reqs[i].request_id)
                aborted.add(reqs[i].request_id)
                queues = [r.request_id for q in (engine.scheduler.waiting, engine.scheduler.running,
                                                 engine.scheduler.swapped) for r in q]
                assert reqs[i].request_id not in queues
                if bm is not None:
                    bm.check_invariants()
                    assert reqs[i].request_id not in bm.block_tables and reqs[i].request_id not in bm.cpu_block_tables
        engine.step()
        step += 1
    assert kv_in_use(engine.scheduler) == 0  # everything given back
    for r in reqs:
        assert r.status == RequestStatus.FINISHED
        if r.request_id in aborted:
            assert r.finish_reason == "abort" and r.num_output_tokens < r.max_new_tokens + 1
        else:
            assert r.num_output_tokens == r.max_new_tokens and r.finish_reason == "length"
    assert not engine.abort_request(reqs[0].request_id) and not engine.abort_request("nobody")


@pytest.mark.parametrize("policy,mode", [("paged", "swap"), ("paged_prefix", "recompute"), ("chunked", "recompute"),
                                         ("orca", None), ("static", None)])
def test_aborting_some_requests_leaves_the_others_exact(paged_setup, policy, mode):
    """Real model under KV pressure: abort r2 (running) and r6 (waiting, or swapped out) after a
    few steps; the other requests' greedy outputs still equal HF generate's."""
    _, runner, prompts, refs = paged_setup
    reqs = [Request(f"r{i}", p, n, GREEDY, arrival_time_s=0.01 * i) for i, (p, n) in enumerate(zip(prompts, MAX_NEW))]
    options = {"static": dict(batch_size=4), "orca": dict(max_num_seqs=4)}.get(
        policy, dict(n_slots=80, block_size=4, max_num_seqs=8))
    if mode:
        options["preemption_mode"] = mode
    engine = make_engine(policy, runner, SimClock(), **options)
    if mode == "swap":
        engine.scheduler.block_manager.num_cpu_blocks = 64
    for r in reqs:
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    seen = {reqs[2].status, reqs[6].status}
    engine.abort_request("r2")
    engine.abort_request("r6")
    engine.generate([])
    assert seen and reqs[2].finish_reason == reqs[6].finish_reason == "abort"
    assert {r.request_id: r.output_token_ids for r in reqs if r.request_id not in ("r2", "r6")} == \
           {k: v for k, v in refs.items() if k not in ("r2", "r6")}
    assert kv_in_use(engine.scheduler) == 0


@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_aborting_a_swapped_request_frees_its_cpu_blocks(policy):
    """A small KV under swap preemption: step until a request is swapped out, abort it; its CPU
    blocks go back at once, it finishes "abort", and every other request still runs to its length."""
    engine = make_engine(policy, SimExecutor(), SimClock(), n_slots=96, block_size=4, max_num_seqs=6,
                         preemption_mode="swap")
    reqs = [Request(f"q{i}", [3] * (8 + 3 * i), 30, GREEDY) for i in range(6)]
    for r in reqs:
        engine.add_request(r)
    bm = engine.scheduler.block_manager
    for _ in range(100):
        if engine.scheduler.swapped:
            break
        engine.step()
    assert engine.scheduler.swapped, "no request was swapped out: the KV is not small enough"
    victim = engine.scheduler.swapped[0]
    assert victim.status == RequestStatus.SWAPPED and bm.cpu_block_tables[victim.request_id]
    assert engine.abort_request(victim.request_id)
    assert victim.request_id not in bm.cpu_block_tables and not bm.cpu_block_tables
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks
    bm.check_invariants()
    assert victim.is_finished and victim.finish_reason == "abort" and victim not in engine.scheduler.swapped
    engine.generate([])
    others = [r for r in reqs if r is not victim]
    assert all(r.finish_reason == "length" and r.num_output_tokens == r.max_new_tokens for r in others)
    assert kv_in_use(engine.scheduler) == 0
