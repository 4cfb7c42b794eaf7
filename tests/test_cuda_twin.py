"""The CUDA tests' own setup, run on the CPU: a settings mistake in ``tests/test_cuda.py`` (a setting a policy does
not have, a swap space too small to preempt) would otherwise only show on a GPU, which CI never has."""

import pytest
import torch

from minibatch import ModelRunner, Request
from minibatch.models import load_model
from minibatch.reference import reference_outputs

from test_cuda import GREEDY, MAX_NEW, PROMPT_LENS, generate


@pytest.fixture(scope="module")
def tiny_cpu():
    model, tok = load_model("tiny-random-llama", device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, min(model.config.vocab_size, 4096), (n,), generator=g).tolist() for n in PROMPT_LENS]
    reqs = [Request(f"r{i}", p, n, GREEDY, arrival_time_s=0.01 * i) for i, (p, n) in enumerate(zip(prompts, MAX_NEW))]
    return model, tok, reqs, reference_outputs(model, reqs)


@pytest.mark.parametrize("policy", ["static", "orca", "paged", "paged_prefix", "chunked", "spec_ngram"])
def test_cuda_engine_settings_on_cpu(tiny_cpu, policy):
    model, tok, reqs, refs = tiny_cpu
    outputs, _ = generate(ModelRunner(model, tok), reqs, policy, n_slots=1024)
    assert outputs == refs


def test_cuda_swap_settings_preempt_on_cpu(tiny_cpu):
    model, tok, reqs, refs = tiny_cpu
    outputs, engine = generate(ModelRunner(model, tok), reqs, "paged", n_slots=80, preemption_mode="swap")
    assert engine.scheduler.num_preemptions > 0 and outputs == refs
