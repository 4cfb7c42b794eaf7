"""Speculative decoding: exact greedy equivalence, the rejection sampler's distribution, rollback, stats."""

import copy

import numpy as np
import pytest
import torch

from minibatch import ModelRunner, Request, SamplingParams
from minibatch.engine import Engine
from minibatch.lessons.speculative import check_rejection_sampler
from minibatch.experiments.spec_exactness import chi_square_pvalue, spec_sequences
from minibatch.policies import make_engine
from minibatch.scheduler import ChunkedPrefillScheduler, PagedScheduler
from minibatch.spec import (AdaptiveK, DraftModelProposer, FixedK, NgramProposer, SpecDecodingStats, SpeculativeRunner,
                            best_k, expected_tokens, greedy_verify, ngram_lookup, processed_probs, rejection_sample)
from minibatch.spec.rejection_sampler import naive_sample
from minibatch.spec.forward_cost import forward_time_s, measure_verify_cost

from conftest import MAX_NEW


def perturbed(model, scale: float, seed: int = 0):
    """A draft that agrees with ``model`` often but not always: its weights plus seeded noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return draft


# ----------------------------------------------------------------------------- pure pieces
def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 4, 1, 2], 2) == [3, 4]
    assert ngram_lookup([1, 2, 3, 4, 1, 2], 5) == [3, 4, 1, 2]  # the continuation may run into the suffix
    assert ngram_lookup([5, 1, 2, 9, 7, 1, 2, 8, 1, 2], 1) == [8]  # the latest match wins
    assert ngram_lookup([1, 2, 3], 3) == []  # nothing recurs
    assert ngram_lookup([7, 7], 3) == [7]
    assert ngram_lookup([9, 1, 2, 3, 0, 2, 3], 2, n_max=3) == [0, 2]  # longest n-gram first: "2 3"
    with pytest.raises(ValueError, match="n_min"):
        ngram_lookup([1], 1, n_max=1, n_min=2)


def test_greedy_verify():
    assert greedy_verify([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert greedy_verify([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # first mismatch: the target's token
    assert greedy_verify([4], []) == [4]


def test_expected_tokens_and_best_k():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert best_k(0.0, 0.1, 8) == 0  # nothing is ever accepted: do not speculate
    assert best_k(0.99, 0.01, 8) == 8
    a, c = 0.8, 0.1  # hand-computed: E(k)/(1+ck) = 1.8/1.1, 2.44/1.2, 2.952/1.3, 3.3616/1.4, 3.689/1.5 ...
    assert best_k(a, c, 8) == max(range(9), key=lambda k: (1 - a ** (k + 1)) / (1 - a) / (1 + c * k))


def test_stats_meanings():
    st = SpecDecodingStats()
    st.observe(4, 4)
    st.observe(4, 1)
    st.observe(2, 0)
    assert st.num_drafts == 3 and st.num_draft_tokens == 10 and st.num_accepted_tokens == 5
    assert st.acceptance_rate == 0.5
    assert st.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert st.num_accepted_tokens_per_pos == [2, 1, 1, 1]
    assert st.acceptance_rate_per_pos == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    # drafted per position: 3, 3, 2, 2
    assert st.conditional_acceptance_per_pos == pytest.approx([2 / 3, 1 / 3, 1 / 2, 1 / 2])


def test_processed_probs_consistent_with_sampler():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
    p = processed_probs(logits, SamplingParams(temperature=0.5, top_k=3))
    assert p[3] == 0 and p[2] == 0 and p.sum() == pytest.approx(1.0)  # top-3 keeps ids 4, 0, 1
    assert torch.equal(processed_probs(logits, SamplingParams()), torch.tensor([0.0, 0, 0, 0, 1]))


# ----------------------------------------------------------------------------- distribution
def test_rejection_sampler_matches_target_distribution():
    counts, expected = spec_sequences(rejection_sample, 20_000)
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_wrong_sampler_is_caught():
    counts, expected = spec_sequences(naive_sample, 20_000)
    assert chi_square_pvalue(counts, expected) < 1e-6
    with pytest.raises(AssertionError, match="chi-square"):
        check_rejection_sampler(naive_sample)


def _small_vocab_models(vocab: int = 5):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.3,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(1)
    draft = LlamaForCausalLM(cfg).eval()
    return target, draft


@torch.inference_mode()
def _exact_joint(model, prompt: list[int], length: int, temperature: float) -> np.ndarray:
    from minibatch.models import set_attention

    set_attention(model, "sdpa")
    V = model.config.vocab_size
    probs = np.ones(1)
    seqs = [[]]
    for _ in range(length):
        rows = [model(torch.tensor([prompt + s])).logits[0, -1] for s in seqs]
        p = torch.stack([processed_probs(r, SamplingParams(temperature=temperature)) for r in rows]).numpy()
        probs = (probs[:, None] * p).reshape(-1)
        seqs = [s + [t] for s in seqs for t in range(V)]
    return probs


@pytest.mark.parametrize("sampler,ok,subset", [(rejection_sample, True, None), (naive_sample, False, None),
                                               (rejection_sample, True, [0, 2, 3])])
def test_engine_sampled_spec_matches_target_distribution(one_thread, sampler, ok, subset):
    """20k requests through the engine (paged, k = 2 draft tokens from a different random model):
    the joint distribution of the first 4 tokens (5^4 = 625 cells) matches the target's exactly
    computed one; the wrong sampler is rejected. A draft restricted to a vocab subset (its q is 0
    elsewhere) is still exact: the residual max(p - q, 0) covers the other tokens."""
    target, draft = _small_vocab_models()
    prompt, n, temp = [1, 3, 4], 20_000, 1.0
    spec = SpeculativeRunner(ModelRunner(target), DraftModelProposer(ModelRunner(draft, vocab_subset=subset)),
                             FixedK(2))
    spec.rejection_sampler = sampler
    sched = PagedScheduler(max_num_seqs=1024, num_blocks=1024, block_size=8, num_lookahead_tokens=2)
    spec.allocate_kv_cache(1024, 8)
    reqs = [Request(f"s{i}", prompt, 4, SamplingParams(temperature=temp, seed=i, ignore_eos=True)) for i in range(n)]
    Engine(sched, spec).generate(reqs)
    counts = np.zeros(5 ** 4)
    for r in reqs:
        counts[np.ravel_multi_index(r.output_token_ids, (5,) * 4)] += 1
    # drafts really were rejected and accepted
    assert spec.stats.num_drafts >= n and 0.05 < spec.stats.acceptance_rate < 0.95
    p = chi_square_pvalue(counts, _exact_joint(target, prompt, 4, temp) * n)
    assert (p > 1e-3) if ok else (p < 1e-6)


# ----------------------------------------------------------------------------- greedy equivalence in the engine
def _engine(model, proposer, speculator, num_blocks=64, block_size=4, max_num_seqs=4, chunked=False, **kw):
    spec = SpeculativeRunner(ModelRunner(model), proposer, speculator)
    cls = ChunkedPrefillScheduler if chunked else PagedScheduler
    extra = {"max_num_batched_tokens": 16} if chunked else {}
    lookahead = speculator.max_k if proposer.writes_kv else 0  # slots for the draft's KV of the next drafts
    sched = cls(max_num_seqs=max_num_seqs, num_blocks=num_blocks, block_size=block_size, num_lookahead_tokens=lookahead,
                **extra, **kw)
    spec.allocate_kv_cache(sched.block_manager.num_blocks, block_size, sched.block_manager.num_cpu_blocks)
    return Engine(sched, spec), spec, sched


def _requests(prompts, max_new=MAX_NEW, **kw):
    return [Request(f"r{i}", p, n, SamplingParams(ignore_eos=True), **kw)
            for i, (p, n) in enumerate(zip(prompts, max_new))]


_LONG_REFS: dict = {}


def _long_refs(model, prompts):
    from minibatch.reference import reference_outputs

    key = model.config.model_type
    if key not in _LONG_REFS:
        _LONG_REFS[key] = reference_outputs(model, _requests(prompts, [3 * n for n in MAX_NEW]))
    return _LONG_REFS[key]


@pytest.mark.parametrize("proposer_kind", ["draft", "self", "ngram"])
@pytest.mark.parametrize("k_policy", ["fixed1", "fixed4", "adaptive"])
@pytest.mark.parametrize("pressure", ["none", "recompute", "swap", "chunked"])
def test_greedy_spec_equals_hf_generate(one_thread, paged_setup, proposer_kind, k_policy, pressure):
    model, runner, prompts, refs = paged_setup
    draft = {"draft": lambda: perturbed(model, 0.004), "self": lambda: model}.get(proposer_kind)
    subset = list(range(0, model.config.vocab_size, 2)) if k_policy == "fixed1" else None  # a cut LM head: still exact
    proposer = NgramProposer() if draft is None else DraftModelProposer(ModelRunner(draft(), vocab_subset=subset))
    speculator = {"fixed1": FixedK(1), "fixed4": FixedK(4), "adaptive": AdaptiveK(max_k=5)}[k_policy]
    kw, max_new = {}, MAX_NEW
    if pressure in ("recompute", "swap"):  # 3x longer outputs in 120 KV slots (the longest request needs 119)
        kw, max_new = dict(num_blocks=30, max_num_seqs=8, preemption_mode=pressure), [3 * n for n in MAX_NEW]
        refs = _long_refs(model, prompts)
    engine, spec, sched = _engine(model, proposer, speculator, chunked=pressure == "chunked", **kw)
    reqs = engine.generate(_requests(prompts, max_new))
    assert {r.request_id: r.output_token_ids for r in reqs} == refs
    if kw:
        assert sched.num_preemptions > 0
    if proposer_kind != "ngram" and k_policy != "adaptive":
        assert spec.stats.num_drafts > 0
    if proposer_kind == "self" and subset is None:
        assert spec.stats.acceptance_rate == 1.0  # the target drafting for itself: every draft accepted
    sched.block_manager.check_invariants()
    assert sched.block_manager.num_used_blocks == 0  # rolled back and freed: no block leaks


def test_batch_one_and_mixed_requests(one_thread, paged_setup):
    """Batch 1, and a batch where some requests never speculate (k = 0) next to ones that do."""
    model, runner, prompts, refs = paged_setup
    engine, spec, _ = _engine(model, DraftModelProposer(ModelRunner(perturbed(model, 0.004))), FixedK(3),
                              max_num_seqs=1)
    assert {r.request_id: r.output_token_ids for r in engine.generate(_requests(prompts))} == refs
    engine, spec, _ = _engine(model, DraftModelProposer(ModelRunner(perturbed(model, 0.004))), FixedK(3))
    reqs = _requests(prompts)
    for r in reqs[::2]:
        r.num_speculative_tokens = 0
    engine.generate(reqs)
    assert {r.request_id: r.output_token_ids for r in reqs} == refs
    plain = {r.request_id for r in reqs[::2]}
    rows = [e for rec in engine.trace for e in rec.entries]
    assert all(e.num_spec_tokens == 0 for e in rows if e.request_id in plain)
    mixed = [rec for rec in engine.trace if any(e.num_spec_tokens for e in rec.entries)
             and any(e.request_id in plain and e.phase == "decode" for e in rec.entries)]
    assert mixed  # speculating and plain decodes really shared a forward


def test_rollback_frees_blocks_and_rewinds(one_thread, paged_setup):
    """A rejected draft's KV slots are rolled back: num_computed_tokens = tokens before + 1 + accepted,
    and the block table holds exactly the blocks its computed tokens need."""
    model, _, prompts, refs = paged_setup
    engine, spec, sched = _engine(model, DraftModelProposer(ModelRunner(perturbed(model, 0.05))), FixedK(6),
                                  num_blocks=128, block_size=2)
    for r in _requests(prompts):
        engine.add_request(r)
    bm, saw_rejection = sched.block_manager, False
    while engine.has_unfinished():
        rec = engine.step()
        for e in rec.entries:
            r = engine.requests[e.request_id]
            if e.num_spec_tokens and not r.is_finished:
                assert r.num_computed_tokens == e.num_computed_tokens + 1 + e.num_accepted_tokens
                assert len(bm.block_tables[r.request_id]) == bm.num_blocks_for(r.num_computed_tokens)
                saw_rejection |= e.num_accepted_tokens < e.num_spec_tokens
    assert saw_rejection
    assert {rid: r.output_token_ids for rid, r in engine.requests.items()} == refs


def test_eos_inside_accepted_drafts():
    """Tokens accepted after EOS are dropped: the request stops exactly where the target would."""
    from minibatch.models import load_model

    model, tok = load_model("tiny-random-llama")
    prompt = [5, 6, 7, 8]
    ref = Request("a", prompt, 30, SamplingParams(ignore_eos=True))
    engine, _, _ = _engine(model, DraftModelProposer(ModelRunner(model)), FixedK(4))
    engine.generate([ref])
    eos = ref.output_token_ids[5]  # pretend the 6th token is EOS
    req = Request("b", prompt, 30, SamplingParams())
    engine, _, _ = _engine(model, DraftModelProposer(ModelRunner(model)), FixedK(4))
    engine.executor.eos_token_ids = (eos,)
    engine.generate([req])
    assert req.output_token_ids == ref.output_token_ids[:ref.output_token_ids.index(eos) + 1]
    assert req.finish_reason == "stop"


def test_adaptive_k_follows_acceptance():
    ak = AdaptiveK(max_k=8, draft_cost_ratio=0.1)
    good, bad = Request("g", [1], 50), Request("b", [1], 50)
    good.spec_history = [(8, 8)] * 60  # (drafted, accepted) per verification, stored by the scheduler's update
    bad.spec_history = [(8, 0)] * 60
    assert ak.num_spec_tokens(good) == 8 and ak.num_spec_tokens(bad) == 0
    # a verify forward costing 1.8 decodes (a CPU): a 30% acceptance rate no longer pays
    assert best_k(0.3, 0.05, 8, verify_cost_ratio=1.0) >= 1 and best_k(0.3, 0.05, 8, verify_cost_ratio=1.8) == 0
    with pytest.raises(ValueError, match="verify_cost_ratio"):
        AdaptiveK(verify_cost_ratio=0)


def test_predicted_speedup_and_break_even():
    from minibatch.experiments.spec_speedup import break_even_alpha, predicted_speedup

    assert predicted_speedup(0.5, 2, 1.0, 0.0) == pytest.approx(1.75)  # 1 + 0.5 + 0.25 tokens per unit
    assert predicted_speedup(0.5, 2, 1.5, 0.25) == pytest.approx(1.75 / 2.0)
    assert break_even_alpha(1, 1.8, 0.0) == pytest.approx(0.8, abs=1e-6)  # 1 + alpha = 1.8


def test_spec_policies_in_make_engine(one_thread, paged_setup):
    model, runner, prompts, refs = paged_setup
    for policy, kw in (("spec", {"draft_runner": ModelRunner(perturbed(model, 0.004))}), ("spec_ngram", {})):
        engine = make_engine(policy, runner, n_slots=512, num_speculative_tokens=3, **kw)
        reqs = engine.generate(_requests(prompts))
        assert {r.request_id: r.output_token_ids for r in reqs} == refs
    with pytest.raises(ValueError, match="draft_runner"):
        make_engine("spec", runner)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine("spec_ngram", runner, num_speculative_tokens=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Request("x", [1], 3, num_speculative_tokens=-1)


def test_measuring_a_runner_leaves_its_engine_working(one_thread, paged_setup):
    """forward_time_s resizes the runner's KV cache: it claims it as an engine does, so the engine that used the
    runner before reallocates its own at its next step (before, it ran on the measurement's few blocks)."""
    model, runner, prompts, refs = paged_setup
    engine = make_engine("paged", runner, n_slots=512)
    first = engine.generate(_requests(prompts[:4]))
    assert measure_verify_cost(runner, k=2, context=8) > 0
    assert forward_time_s(runner, 1, 40, repeats=1) > 0
    again = engine.generate([Request(f"again{i}", p, n, SamplingParams(ignore_eos=True))
                             for i, (p, n) in enumerate(zip(prompts, MAX_NEW))])
    assert {r.request_id: r.output_token_ids for r in first} == {f"r{i}": refs[f"r{i}"] for i in range(4)}
    assert {r.request_id.replace("again", "r"): r.output_token_ids for r in again} == refs
    engine.add_request(Request("held", prompts[0], 5, SamplingParams(ignore_eos=True)))
    engine.step()  # the engine now holds KV: a measurement would overwrite it
    with pytest.raises(RuntimeError, match="still holds KV"):
        forward_time_s(runner)
    engine.abort_request("held")  # (the session's runner is shared with later tests)
    assert not engine.holds_kv


def test_make_engine_speculator_override(one_thread, paged_setup):
    """A speculator object replaces the one num_speculative_tokens / adaptive_k build; its max_k sets
    the draft model's lookahead KV slots. Refused on a policy without a proposer, or next to a
    different num_speculative_tokens / adaptive_k."""
    model, runner, prompts, refs = paged_setup
    ak = AdaptiveK(max_k=5, verify_cost_ratio=1.5)
    engine = make_engine("spec", runner, n_slots=512, draft_runner=ModelRunner(perturbed(model, 0.004)), speculator=ak)
    assert engine.executor.speculator is ak and engine.scheduler.num_lookahead_tokens == 5
    assert {r.request_id: r.output_token_ids for r in engine.generate(_requests(prompts))} == refs
    assert make_engine("spec_ngram", runner, speculator=FixedK(2)).scheduler.num_lookahead_tokens == 0
    with pytest.raises(ValueError, match="speculator"):
        make_engine("paged", runner, speculator=FixedK(2))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine("spec_ngram", runner, speculator=FixedK(2), num_speculative_tokens=3)
    with pytest.raises(ValueError, match="adaptive_k"):
        make_engine("spec_ngram", runner, speculator=FixedK(2), adaptive_k=True)
    with pytest.raises(ValueError, match="speculator.max_k"):
        make_engine("spec_ngram", runner, speculator=FixedK(0))


def test_stream_yields_every_token(one_thread, paged_setup):
    model, runner, prompts, refs = paged_setup
    engine, _, _ = _engine(model, DraftModelProposer(ModelRunner(model)), FixedK(4))
    got: dict[str, list[int]] = {}
    for ev in engine.stream(_requests(prompts)):
        got.setdefault(ev.request_id, []).append(ev.token_id)
    assert got == refs


def test_simulated_speedup_shrinks_with_batch_size():
    """On the simulated clock a small batch gains from speculation and a large one loses: the
    speedup falls monotonically and crosses 1 (section 4 of notebook 06)."""
    from minibatch.experiments.spec_speedup import batch_sweep_sim

    rows = batch_sweep_sim(acceptance_rate=0.7, ks=(4,), batch_sizes=(1, 4, 16, 64), output_len=64)
    speedups = [r["speedup"] for r in rows]
    assert speedups == sorted(speedups, reverse=True)
    assert speedups[0] > 1.2 and speedups[-1] < 1.0


def test_sim_executor_acceptance_rate():
    from minibatch.sim.executor import SimExecutor

    ex = SimExecutor(acceptance_rate=0.6, seed=1, speculator=FixedK(4))
    sched = PagedScheduler(max_num_seqs=16, num_blocks=512, num_lookahead_tokens=4)
    Engine(sched, ex).generate([Request(f"r{i}", [5] * 8, 200, SamplingParams(ignore_eos=True)) for i in range(16)])
    # i.i.d. acceptance, stop at the first rejection: P(position i accepted) = 0.6^(i+1)
    assert ex.stats.acceptance_rate_per_pos == pytest.approx([0.6, 0.36, 0.216, 0.1296], abs=0.03)
    with pytest.raises(ValueError, match="acceptance_rate"):
        SimExecutor(acceptance_rate=1.5)
    with pytest.raises(ValueError, match="needs acceptance_rate"):  # at construction, not at the first step
        SimExecutor(speculator=FixedK(4))
    with pytest.raises(ValueError, match="needs acceptance_rate"):
        SimExecutor().with_speculator(FixedK(4))
    # per-position rates: past the list, the last ratio (0.6 / 0.8) repeats
    ex = SimExecutor(acceptance_rate=[0.8, 0.6], seed=2, speculator=FixedK(3))
    Engine(PagedScheduler(max_num_seqs=16, num_blocks=512, num_lookahead_tokens=3), ex).generate(
        [Request(f"r{i}", [5] * 8, 200, SamplingParams(ignore_eos=True)) for i in range(16)])
    assert ex.stats.acceptance_rate_per_pos == pytest.approx([0.8, 0.6, 0.45], abs=0.03)


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_adaptive_k_learns_alpha_in_simulation(p):
    """Drafts accepted with a constant per-token probability p (Leviathan's alpha) on a SimExecutor:
    after 1000+ draft tokens AdaptiveK's alpha estimate is within 0.05 of p, and the k it picks for
    a request is the k its own cost model says is best for p. The feedback reaches it through the
    step records and the requests' spec_history, as with a real model."""
    from minibatch.sim.executor import SimExecutor

    ak = AdaptiveK(max_k=8, draft_cost_ratio=0.05)
    ex = SimExecutor(acceptance_rate=p, seed=7)
    engine = make_engine("spec", ex, speculator=ak, n_slots=1 << 16, max_num_seqs=16)
    reqs = [Request(f"r{i}", [5] * 8, 400, SamplingParams(ignore_eos=True)) for i in range(8)]
    engine.generate(reqs)
    assert ex.stats.num_draft_tokens >= 1000
    assert ak.alpha() == pytest.approx(p, abs=0.05)
    assert ak.num_spec_tokens(Request("new", [5], 100)) == best_k(p, 0.05, 8)
    # vLLM's acceptance rate (accepted / drafted) is a different quantity, below alpha
    assert ex.stats.acceptance_rate < ak.alpha()
