"""The Python API a notebook calls, given what a student or researcher plausibly passes by mistake: a clear error
naming the argument before any work, never a hang, a half-run object or a silently ignored setting."""

import math

import numpy as np
import pytest

from minibatch import (CostModel, FixedK, ModelRunner, Request, SamplingParams, SimClock, SimExecutor, WallClock,
                       make_engine)
from minibatch.cluster.cluster import Cluster, KVLink
from minibatch.cluster.routers import Router, get_router
from minibatch.experiment import run
from minibatch.kv.block_manager import BlockManager
from minibatch.kv.contiguous import kv_bytes_per_token
from minibatch.lessons.cluster import run_cluster
from minibatch.lessons.exercise import expect, miss
from minibatch.metrics import summarize
from minibatch.models import load_model
from minibatch.request import fork_requests
from minibatch.spec.speculator import expected_tokens, predicted_speedup
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
    (None, SimExecutor, "executor must be a ModelRunner or SimExecutor"),  # the class, not an instance
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


# ----------------------------------------------------------------------------- constructors and helpers
@pytest.mark.parametrize("make, message", [
    (lambda: SimExecutor(max_model_len=0), "max_model_len must be an int >= 1"),
    (lambda: SimExecutor(vocab_size=1.5), "vocab_size must be an int >= 1"),
    (lambda: SimExecutor(acceptance_rate=True), "acceptance_rate"),
    (lambda: SimExecutor(acceptance_rate="0.5"), "acceptance_rate"),
    (lambda: SimExecutor(proposal_rate=2), "proposal_rate"),
    (lambda: fork_requests(Request("a", [1], 2), 1.5), "n must be an int in"),
    (lambda: fork_requests(Request("a", [1], 2), True), "n must be an int in"),
    (lambda: FixedK(2.5), r"num_speculative_tokens \(k\) must be an int in \[0, 64\]"),
    (lambda: FixedK(100), r"num_speculative_tokens \(k\) must be an int in \[0, 64\]"),
    (lambda: expected_tokens(2.0, 4), "alpha"),  # returned 31
    (lambda: predicted_speedup(0.5, 4, 0, 0), "verify_cost_ratio"),  # ZeroDivisionError
    (lambda: load_model("tiny-random-llama", device="gpu"), "device must be cpu, cuda or cuda:N"),
    (lambda: ModelRunner("tiny-random-llama"), r"model must be a model object \(load_model\(name\)\[0\]\)"),
    (lambda: make_engine("paged", SimExecutor(), draft_runner=object()), "draft_runner applies only"),
    (lambda: run("hf_generate", trace(2), SimExecutor()), "runs the model itself: pass model="),
    (lambda: run_cluster(), "run_cluster needs conversations"),
    (lambda: run_cluster(requests=["a"]), "requests must be Requests"),
])
def test_api_arguments_are_named_when_wrong(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_a_vocab_subset_must_hold_ids_of_the_model(one_thread):
    model, tokenizer = load_model("tiny-random-llama")
    for subset, message in (([], "vocab_subset must hold >= 1 token id"), ([10**9], r"vocab_subset\[0\]")):
        with pytest.raises(ValueError, match=message):  # [] generated only token 0; 10**9 an IndexError
            ModelRunner(model, tokenizer, vocab_subset=subset)


def test_a_run_cluster_request_past_the_profiled_context_is_refused():
    with pytest.raises(ValueError, match=r"must be <= max_model_len \(8192\)"):
        run_cluster(requests=[Request("big", [100] * 9000, 4, GREEDY)], replicas=1)


@pytest.mark.parametrize("answer, measured, said", [
    (np.float64(3.5), 3, "is too high"),  # an np.bool_ index raised TypeError, blamed on the student
    (np.int64(3), 4, "is too low"),
    ([1, 2], (1, 2), "has the right entries but must be a tuple"),  # IndexError
    (5, {1, 2}, "must be a set of 2"),  # TypeError
    (np.array([1, 2]), [1, 3], "must be a list of 2"),
])
def test_an_exercise_says_how_an_answer_misses_whatever_its_type(answer, measured, said):
    assert miss(answer, measured) == said


@pytest.mark.parametrize("policy, request_kwargs, message", [
    ("paged", dict(num_speculative_tokens=2), "num_speculative_tokens applies only under a speculative policy"),
    ("orca", dict(num_external_computed_tokens=2), "num_external_computed_tokens .* needs a paged scheduler"),
    ("static", dict(num_external_computed_tokens=2), "num_external_computed_tokens .* needs a paged scheduler"),
])
def test_a_request_setting_its_policy_would_ignore_is_refused(policy, request_kwargs, message):
    engine = make_engine(policy, SimExecutor(), SimClock())
    with pytest.raises(ValueError, match=message):
        engine.add_request(Request("a", [1, 2, 3, 4], 3, GREEDY, **request_kwargs))
    assert not engine.requests  # refused whole: the engine is as it was


@pytest.mark.parametrize("make, message", [
    (lambda: BlockManager(2.5, 4), "num_blocks must be an int >= 1"),
    (lambda: BlockManager(4, 4, watermark=1.0), r"watermark must be a finite number in \[0.0, 1.0\)"),
    (lambda: kv_bytes_per_token(-1, 2, 64), "num_layers must be an int >= 1"),
])
def test_kv_sizes_are_checked(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_disaggregated_cluster_needs_paged_decode_replicas_and_takes_a_generator():
    orca = [make_engine("orca", SimExecutor(), SimClock(), n_slots=256) for _ in range(2)]
    with pytest.raises(ValueError, match="a decode replica needs a paged scheduler"):
        Cluster(orca, get_router("round_robin"), roles=["prefill", "decode"])
    cluster = Cluster(engines(), get_router("round_robin"))
    assert len(cluster.run(r for r in trace()).requests) == 6  # a generator, not spent by the checks


def test_logprobs_zero_is_a_request_the_hf_baselines_refuse(one_thread):
    model, _ = load_model("tiny-random-llama")
    with pytest.raises(ValueError, match="hf_generate does not apply sampling logprobs"):
        run("hf_generate", [Request("s", [1, 2, 3], 4, SamplingParams(logprobs=0))], None, model=model)


@pytest.mark.parametrize("answer, measured, correct", [
    ([1, 2], (1, 2), True), ((1, [2, 3]), [1, (2, 3)], True), (np.array([1, 2]), [1, 2], False),
    (np.float64(3.0), 3, True), ("3", 3, False),
])
def test_an_exercise_compares_answers_of_any_type(answer, measured, correct):
    if correct:
        assert expect(answer, measured) == measured
    else:
        with pytest.raises(AssertionError, match="my_prediction"):  # a sentence, never the array's ValueError
            expect(answer, measured)


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(sampling=SamplingParams(min_tokens=2)), "sets sampling min_tokens, which hf_generate_batch does not apply"),
    (dict(num_speculative_tokens=2), "sets num_speculative_tokens, but static does not speculate"),
])
def test_compare_refuses_a_trace_a_selected_policy_would_refuse_midway(tmp_path, capsys, request_kwargs, message):
    """Before, the other policies ran (minutes) and the comparison then failed at hf_generate_batch or static."""
    from minibatch.__main__ import main

    save_trace([Request("a", [5, 6, 7], 4, **request_kwargs)], tmp_path / "t.json")
    with pytest.raises(SystemExit) as info:
        main(["compare", "--model", "tiny-random-llama", "--trace", str(tmp_path / "t.json")])
    assert info.value.code == 2 and f"--trace: request 'a' {message}" in capsys.readouterr().err
