"""The reference outputs on several CPU threads (``baselines.alone.generate_alone``): requests generated side by
side, each alone on one torch thread and its own shallow copy of the model, give exactly what one after another
gives; the model's generation_config and torch's thread count come back unchanged, also when a request fails."""

import pytest
import torch

from minibatch.baselines.alone import generate_alone, reference_workers
from minibatch.models import load_model
from minibatch.reference import _generation_config, reference_outputs
from minibatch.request import Request, SamplingParams


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _requests(n: int = 5) -> list[Request]:
    g = torch.Generator().manual_seed(11)
    return [Request(f"r{i}", torch.randint(3, 512, (3 + 4 * i,), generator=g).tolist(), 2 + 3 * (i % 3),
                    SamplingParams(ignore_eos=i % 2 == 0)) for i in range(n)]


@pytest.mark.parametrize("logprobs", [0, 3])
def test_side_by_side_equals_one_after_another(two_threads, logprobs):
    model, reqs = load_model("tiny-random-llama")[0], _requests()
    config, threads = model.generation_config, torch.get_num_threads()
    assert reference_workers(model, len(reqs)) == 2 and reference_workers(model, 1) == 1
    together = generate_alone(model, reqs, _generation_config, logprobs=logprobs)
    assert model.generation_config is config and torch.get_num_threads() == threads
    torch.set_num_threads(1)
    assert reference_workers(model, len(reqs)) == 1
    assert generate_alone(model, reqs, _generation_config, logprobs=logprobs) == together
    torch.set_num_threads(threads)
    assert reference_outputs(model, reqs, logprobs=logprobs) == reference_outputs(model, reqs[::-1],
                                                                                  logprobs=logprobs)


def test_a_failing_request_raises_and_restores(two_threads):
    model, reqs = load_model("tiny-random-llama")[0], _requests(4)
    bad = Request("bad", [10**6], 3, SamplingParams(ignore_eos=True))  # no such token: the embedding fails
    config = model.generation_config
    with pytest.raises(IndexError):
        generate_alone(model, reqs[:2] + [bad] + reqs[2:], _generation_config)
    assert model.generation_config is config and torch.get_num_threads() == 2
