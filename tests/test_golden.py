"""Refactoring guard: every policy's schedule (StepRecords on the simulated clock) and outputs,
on three traces, equal the recorded golden ones (``tests/golden_runs.py`` explains and rewrites them)."""

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


def test_every_policy_has_a_golden_case():
    from minibatch.policies import ENGINE_POLICIES

    assert {policy for _, policy, _, _ in SIM_CASES} == set(ENGINE_POLICIES)
