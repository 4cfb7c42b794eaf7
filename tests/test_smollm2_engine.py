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
