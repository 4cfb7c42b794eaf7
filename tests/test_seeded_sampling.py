"""Seeded sampling and the schedule: which policies give a seeded request the same tokens.

What ``SamplingParams``, ``minibatch.spec.rejection_sampler`` and the README state, pinned:
every non-speculative policy (with or without preemption) and ``spec_ngram`` (any k) give the same
seeded samples; ``spec`` (a draft model) repeats exactly on the simulated clock but its tokens depend
on the schedule. That ``spec`` still samples exactly the target's distribution in every schedule is
``tests/test_spec.py::test_engine_sampled_spec_matches_target_distribution``; the n-gram path's
distribution is checked here.
"""

import numpy as np
import pytest

from minibatch import ModelRunner, Request, SamplingParams
from minibatch.engine import Engine
from minibatch.experiments.spec_exactness import chi_square_pvalue
from minibatch.policies import make_engine
from minibatch.scheduler import PagedScheduler
from minibatch.clock import SimClock
from minibatch.spec import FixedK, NgramProposer, SpeculativeRunner, greedy_verify, sample_verify

from test_spec import _exact_joint, _small_vocab_models

# 48 KV slots in blocks of 4 for six requests of up to 33 tokens: preemptions are certain
PRESSURE = dict(n_slots=48, block_size=4)


@pytest.fixture(scope="module")
def models(one_thread):
    """A 5-token-vocab target and a different random draft: n-gram drafts are often right (and
    often wrong), so every verification path really runs."""
    target, draft = _small_vocab_models()
    return ModelRunner(target), ModelRunner(draft)


def _requests() -> list[Request]:
    return [Request(f"r{i}", [1, 3, 4, 3][: 2 + i % 3] * (1 + i), 24,
                    SamplingParams(temperature=1.0, seed=10 + i, ignore_eos=True)) for i in range(6)]


def _run(policy: str, runner, **kw) -> tuple[dict[str, list[int]], Engine]:
    engine = make_engine(policy, runner, SimClock(), **kw)
    reqs = engine.generate(_requests())
    return {r.request_id: r.output_token_ids for r in reqs}, engine


def _preemptions(engine: Engine) -> int:
    return sum(r.num_preemptions for r in engine.requests.values())


def test_non_speculative_policies_agree(models):
    runner, _ = models
    ref, _ = _run("orca", runner)
    for policy, kw in [("static", dict(batch_size=4)), ("paged", {}), ("chunked", dict(max_num_batched_tokens=8)),
                       ("paged", dict(PRESSURE)), ("paged", dict(PRESSURE, preemption_mode="swap")),
                       ("chunked", dict(PRESSURE, max_num_batched_tokens=8))]:
        out, engine = _run(policy, runner, **kw)
        assert out == ref, (policy, kw)
        assert _preemptions(engine) > 0 if "n_slots" in kw else True


@pytest.mark.parametrize("kw", [{}, dict(num_speculative_tokens=1), dict(adaptive_k=True), dict(PRESSURE)],
                         ids=["k4", "k1", "adaptive", "preempted"])
def test_spec_ngram_gives_the_non_speculative_samples(models, kw):
    """n-gram drafts are checked against the target's own draws (``sample_verify``): same tokens."""
    runner, _ = models
    ref, _ = _run("orca", runner)
    out, engine = _run("spec_ngram", runner, **kw)
    assert out == ref
    stats = engine.executor.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts accepted and rejected
    if "n_slots" in kw:
        assert _preemptions(engine) > 0


@pytest.mark.parametrize("policy", ["spec", "spec_ngram"])
@pytest.mark.parametrize("pressure", [False, True])
def test_speculative_runs_repeat(models, policy, pressure):
    runner, draft = models
    kw = dict(PRESSURE) if pressure else {}
    if policy == "spec":
        kw["draft_runner"] = draft
    (a, _), (b, _) = _run(policy, runner, **kw), _run(policy, runner, **kw)
    assert a == b


def test_spec_with_a_draft_model_depends_on_the_schedule(models):
    """Documented, not fixed: under ``spec`` a verified position draws a uniform (and a residual on
    rejection) where a plain decode draws from p, so for these fixed seeds the tokens change with k,
    with preemptions, and differ from the non-speculative ones (each schedule still samples the
    target's distribution exactly: tests/test_spec.py)."""
    runner, draft = models
    ref, _ = _run("orca", runner)
    k4, engine = _run("spec", runner, draft_runner=draft)
    assert engine.executor.stats.num_accepted_tokens > 0
    k2, _ = _run("spec", runner, draft_runner=draft, num_speculative_tokens=2)
    preempted, engine = _run("spec", runner, draft_runner=draft, **PRESSURE)
    assert _preemptions(engine) > 0
    for other in (ref, k2, preempted):
        assert other != k4
        assert sorted(other) == sorted(k4) and all(len(other[r]) == len(k4[r]) for r in k4)


def test_sample_verify_draws_once_per_emitted_token():
    calls = []

    def draw(i):
        calls.append(i)
        return [5, 6, 9, 8][i]

    assert sample_verify([5, 6, 7], draw) == [5, 6, 9] and calls == [0, 1, 2]  # stops at the mismatch
    assert sample_verify([5, 6, 9], lambda i: [5, 6, 9, 8][i]) == [5, 6, 9, 8]  # all accepted + bonus
    assert sample_verify([], lambda i: 4) == [4]
    for drafts in ([5, 6, 7], [5, 6, 9], [1]):
        assert sample_verify(drafts, lambda i: [5, 6, 9, 8][i]) == greedy_verify([5, 6, 9, 8][:len(drafts) + 1], drafts)


def test_spec_ngram_samples_the_target_distribution(models):
    """6000 seeded requests through spec_ngram: the joint distribution of the first 3 tokens
    (125 cells) is the target's exactly computed one."""
    runner, _ = models
    prompt, n = [1, 3, 0, 4, 2, 3, 1], 6000  # every token occurs: n-gram lookup always drafts
    spec = SpeculativeRunner(runner, NgramProposer(), FixedK(2))
    sched = PagedScheduler(max_num_seqs=1024, num_blocks=2048, block_size=8)  # n-gram drafts need no lookahead slots
    spec.allocate_kv_cache(2048, 8)
    reqs = [Request(f"s{i}", prompt, 3, SamplingParams(temperature=1.0, seed=i, ignore_eos=True)) for i in range(n)]
    Engine(sched, spec).generate(reqs)
    counts = np.zeros(5 ** 3)
    for r in reqs:
        counts[np.ravel_multi_index(r.output_token_ids, (5,) * 3)] += 1
    assert spec.stats.num_drafts >= n and 0.05 < spec.stats.acceptance_rate < 0.95
    assert chi_square_pvalue(counts, _exact_joint(runner.model, prompt, 3, 1.0) * n) > 1e-3
