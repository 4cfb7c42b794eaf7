"""Greedy equivalence on the real offline model (SmolLM2-135M-Instruct, fp32): every scheduler's
tokens equal HF generate on each request alone."""

import pytest
import torch

from minibatch import ModelRunner, Request, SamplingParams, SimClock, make_engine
from minibatch.models import load_model
from minibatch.prompts import chat_prompt_ids, demo_prompts


@pytest.fixture(scope="module")
def smollm2():
    model, tok = load_model("smollm2-135m")
    prompts = [chat_prompt_ids(tok, text) for text in demo_prompts()[:4]]
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)
        refs.append(out[0, len(p):].tolist())
    return ModelRunner(model, tok), prompts, refs


@pytest.mark.parametrize("policy", ["static", "orca"])
def test_smollm2_greedy_matches_hf_generate(smollm2, policy):
    runner, prompts, refs = smollm2
    reqs = [Request(f"r{i}", p, 10, SamplingParams(ignore_eos=True), arrival_time_s=0.03 * i)
            for i, p in enumerate(prompts)]
    shared = dict(batch_size=3, max_num_seqs=3, n_slots=512, max_wait_s=0.05)  # each policy takes its own
    make_engine(policy, runner, SimClock(), config=shared).generate(reqs)
    assert [r.output_token_ids for r in reqs] == refs


@pytest.mark.parametrize("policy,backend", [("paged", "sdpa"), ("chunked", "sdpa"), ("paged", "compiled"),
                                            ("chunked", "cpp")])
def test_smollm2_fast_backends_match_hf_generate(smollm2, policy, backend):
    """The fast attention backends on the real model, fp32: token-exact with HF generate."""
    runner, prompts, refs = smollm2
    fast = ModelRunner(runner.model, runner.tokenizer, attention_backend=backend)
    reqs = [Request(f"r{i}", p, 10, SamplingParams(ignore_eos=True), arrival_time_s=0.03 * i)
            for i, p in enumerate(prompts)]
    make_engine(policy, fast, SimClock(), max_num_seqs=3, n_slots=512).generate(reqs)
    assert [r.output_token_ids for r in reqs] == refs


def test_smollm2_bf16_is_logprob_close_and_a_broken_engine_is_caught():
    """The bf16 rule on the real model: every policy that batches differently passes it; an engine that
    loses each request's first KV block at every decode step fails it."""
    from minibatch.equivalence import check_outputs
    from minibatch.experiment import run
    from minibatch.reference import reference_outputs
    from test_precision import DropsFirstBlock

    model, tok = load_model("smollm2-135m", dtype="bfloat16")
    reqs = [Request(f"r{i}", chat_prompt_ids(tok, text), 16, SamplingParams(ignore_eos=True, logprobs=5),
                    arrival_time_s=0.02 * i) for i, text in enumerate(demo_prompts()[:4])]
    refs = reference_outputs(model, reqs, logprobs=5)
    shared = dict(max_num_seqs=4, n_slots=512, block_size=16)
    for policy, backend in (("paged", "torch"), ("chunked", "torch"), ("paged", "sdpa"), ("chunked", "sdpa"),
                            ("paged", "cpp"), ("chunked", "cpp")):
        good = run(policy, reqs, ModelRunner(model, tok, attention_backend=backend), SimClock(), config=shared)
        report = check_outputs(good.requests, refs, "logprob-close")
        assert report["passed"] is True, (policy, backend, report)
    bad = run("paged", reqs, DropsFirstBlock(model, tok), SimClock(), config=shared)
    assert check_outputs(bad.requests, refs, "logprob-close")["passed"] is False
