"""Refactoring guard: every policy's schedule (StepRecords on the simulated clock) and outputs,
on three traces, equal the recorded golden ones (``tests/golden_runs.py`` explains and rewrites them).

History: recorded before the step contract of StepResult / drafts stored on the request; the
non-speculative cases were identical after it; the speculative ones were recorded again then
(drafts proposed after sampling, AdaptiveK estimating Leviathan's alpha, no draft slots held for
n-gram lookups that find nothing), with the tiny model's greedy outputs unchanged."""

import pytest

from golden_runs import SIM_CASES, TRACES, golden_runs, load_golden, tiny_model


@pytest.fixture(scope="module")
def model_factory(one_thread):
    return tiny_model()


@pytest.mark.parametrize("trace", TRACES)
def test_schedules_equal_golden(trace, model_factory):
    golden = load_golden(trace)
    runs = golden_runs(trace, model_factory)
    assert sorted(runs) == sorted(golden)
    for name, run in runs.items():
        assert run["outputs"] == golden[name]["outputs"], name
        assert len(run["steps"]) == len(golden[name]["steps"]), name
        for got, want in zip(run["steps"], golden[name]["steps"]):
            assert got == want, (name, got["step"])


def test_speculation_keeps_greedy_outputs():
    """Speculative decoding is exact: the tiny model's greedy outputs equal the plain paged run's."""
    golden = load_golden("poisson")
    assert golden["model_spec"]["outputs"] == golden["model_spec_ngram"]["outputs"] == golden["model_paged"]["outputs"]


def test_every_policy_has_a_golden_case():
    from minibatch.policies import BUILTIN_POLICIES

    assert {policy for _, policy, _, _ in SIM_CASES} == set(BUILTIN_POLICIES)
