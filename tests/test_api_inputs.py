"""The Python API a notebook calls, given what a student or researcher plausibly passes by mistake: a clear error
naming the argument before any work, never a hang, a half-run object or a silently ignored setting."""

import math

import pytest

from minibatch import CostModel, Request, SamplingParams, SimClock, SimExecutor, WallClock, make_engine
from minibatch.cluster.cluster import Cluster, KVLink
from minibatch.cluster.routers import Router, get_router
from minibatch.experiment import run
from minibatch.metrics import summarize
from minibatch.models import load_model
from minibatch.request import fork_requests
from minibatch.trace_io import load_trace, save_trace

GREEDY = SamplingParams(ignore_eos=True)


def trace(n=6, prefix="r"):
    return [Request(f"{prefix}{i}", [1, 2, 3, 4], 4, GREEDY, arrival_time_s=0.01 * i) for i in range(n)]


def engines(n=2):
    return [make_engine("paged", SimExecutor(), SimClock(), n_slots=64) for _ in range(n)]


# ----------------------------------------------------------------------------- clocks and cost models
@pytest.mark.parametrize("value", [math.nan, -0.02, math.inf, "x"])
def test_a_cost_model_refuses_a_cost_no_step_can_take(value):
    with pytest.raises(ValueError, match=r"CostModel.fixed_s \(seconds\) must be a finite number in \[0.0, "):
        CostModel(fixed_s=value)


class NanCost:
    def step_time_s(self, shape):
        return math.nan

    def forward_time_s(self, rows, num_tokens, context):
        return 0.0


def test_a_nan_step_time_fails_the_step_instead_of_stalling_the_run():
    """A NaN timeline admitted no arrival again: generate() looped for ever."""
    engine = make_engine("paged", SimExecutor(), SimClock(NanCost()))
    with pytest.raises(ValueError, match="priced a step at nan s"):
        engine.generate(trace(3))


@pytest.mark.parametrize("clock, executor, message", [
    ("sim", SimExecutor(), "clock must be an object with start_step"),
    (WallClock, SimExecutor(), "clock must be an object with start_step"),
    (None, SimExecutor, "executor must be an object with execute"),
])
def test_make_engine_refuses_a_name_or_class_for_an_object(clock, executor, message):
    with pytest.raises(TypeError, match=message):
        make_engine("paged", executor, clock)


def test_a_sim_clock_refuses_a_cost_model_that_is_not_one():
    with pytest.raises(TypeError, match="SimClock cost_model must be a CostModel or a calibrated Profile"):
        SimClock(5)


# ----------------------------------------------------------------------------- aborts in a summary
def test_summarize_leaves_aborted_requests_out_and_counts_them():
    engine = make_engine("paged", SimExecutor(), SimClock())
    for r in trace(3) + [Request("late", [1, 2, 3, 4], 3, GREEDY, arrival_time_s=10.0)]:
        engine.add_request(r)
    engine.step()
    assert engine.abort_request("r1") and engine.abort_request("late")
    while engine.has_unfinished():
        engine.step()
    late = engine.requests["late"]
    assert late.finish_time_s >= late.arrival_time_s  # aborted before it arrived: not finished before it
    summary = summarize(list(engine.requests.values()), engine.trace)
    assert (summary.num_requests, summary.num_aborted) == (2, 2)
    assert summary.to_dict()["num_aborted"] == 2
    with pytest.raises(ValueError, match="all 2 requests were aborted"):
        summarize([engine.requests["r1"], late])


# ----------------------------------------------------------------------------- clusters
def test_a_request_no_replica_can_hold_fails_before_any_step():
    replicas = engines()
    cluster = Cluster(replicas, get_router("round_robin"))
    with pytest.raises(ValueError, match="request 'big' needs 7 KV blocks"):
        cluster.run(trace() + [Request("big", [1] * 100, 4, GREEDY, arrival_time_s=1.0)])  # (it came after steps)
    assert not any(e.trace or e.requests for e in replicas)  # nothing ran: the cluster is still fresh
    assert len(cluster.run(trace()).requests) == 6


def test_a_cluster_runs_once_and_refuses_repeated_ids():
    cluster = Cluster(engines(), get_router("round_robin"))
    cluster.run(trace())
    with pytest.raises(ValueError, match="a Cluster runs once"):
        cluster.run(trace())
    with pytest.raises(ValueError, match="request_id 'r0' is given twice"):
        Cluster(engines(), get_router("round_robin")).run(trace() + trace())


class IndexRouter(Router):
    def route(self, request, replicas, now_s):
        return 0  # an index, not a replica


def test_a_router_must_return_one_of_its_replicas():
    with pytest.raises(ValueError, match="IndexRouter.route must return one of the replicas it is given, got 0"):
        Cluster(engines(), IndexRouter()).run(trace())


@pytest.mark.parametrize("make, message", [
    (lambda: Cluster(engines(), "round_robin"), "router must be a Router instance"),
    (lambda: Cluster(engines(), get_router("round_robin"), max_outstanding=0), "max_outstanding"),
    (lambda: Cluster(engines(), get_router("round_robin"), kv_bytes_per_token=-5), "kv_bytes_per_token"),
    (lambda: KVLink(bytes_per_s=0.0), "KVLink.bytes_per_s"),
    (lambda: KVLink(latency_s=-1.0), "KVLink.latency_s"),
])
def test_cluster_arguments_are_checked_when_built(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ----------------------------------------------------------------------------- baselines and traces
@pytest.mark.parametrize("policy, sampling, field", [
    ("hf_generate_batch", SamplingParams(stop_token_ids=[365]), "stop_token_ids"),  # crashed after the whole run
    ("hf_generate", SamplingParams(min_tokens=2), "min_tokens"),
    ("hf_generate_batch", SamplingParams(min_tokens=2), "min_tokens"),
])
def test_hf_baselines_refuse_sampling_they_do_not_apply(one_thread, policy, sampling, field):
    model, _ = load_model("tiny-random-llama")
    with pytest.raises(ValueError, match=f"{policy} does not apply sampling {field}"):
        run(policy, [Request("s", [1, 2, 3], 6, sampling)], None, model=model)


def test_a_trace_keeps_forks_speculative_k_and_external_kv(tmp_path):
    requests = fork_requests(Request("p", [1, 2, 3], 4, SamplingParams(temperature=1.0, seed=1),
                                     num_speculative_tokens=2), 2)
    requests.append(Request("x", [1, 2, 3, 4], 3, num_external_computed_tokens=2))
    save_trace(requests, tmp_path / "t.json")
    back = load_trace(tmp_path / "t.json")
    assert [(r.request_id, r.parent_request_id, r.num_speculative_tokens, r.num_external_computed_tokens)
            for r in back] == [("p", None, 2, 0), ("p.1", "p", 2, 0), ("x", None, None, 2)]


@pytest.mark.parametrize("requests", [Request("a", [1], 1), [1]])
def test_save_trace_refuses_what_is_not_a_list_of_requests(tmp_path, requests):
    with pytest.raises(TypeError, match="requests must be a list of Requests"):
        save_trace(requests, tmp_path / "t.json")
