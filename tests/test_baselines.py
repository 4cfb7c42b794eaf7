"""The outside baselines: HF generate on static batches and HF continuous batching.

Token-exact against ``model.generate`` on each request alone, with the same time stamps our engine
fills, and run_hf_generate's batches follow the StaticScheduler rule.
"""

import pytest
import torch

from minibatch.baselines import run_hf_generate, run_hf_generate_batch
from minibatch.models import load_model
from minibatch.request import Request, RequestStatus, SamplingParams

GREEDY = SamplingParams(ignore_eos=True)
PROMPT_LENS = [5, 17, 9, 30, 3]
MAX_NEW = [8, 3, 12, 6, 10]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def hf_reference(model, prompt, max_new_tokens):
    """HF generate on one request alone, greedy, no EOS stop."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def setup():
    model, _ = load_model("tiny-random-llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    refs = [hf_reference(model, p, n) for p, n in zip(prompts, MAX_NEW)]
    return model, prompts, refs


def make_requests(prompts, gap_s=0.01, sampling=GREEDY, max_new=MAX_NEW):
    return [Request(f"r{i}", p, n, sampling, arrival_time_s=gap_s * i)
            for i, (p, n) in enumerate(zip(prompts, max_new))]


def check_stamps(reqs):
    for r in reqs:
        assert r.status == RequestStatus.FINISHED and r.finish_reason in ("stop", "length")
        assert len(r.token_times_s) == r.num_output_tokens >= 1
        assert r.token_times_s == sorted(r.token_times_s), r.request_id
        assert r.first_scheduled_time_s is not None
        assert r.arrival_time_s <= r.first_scheduled_time_s <= r.token_times_s[0]
        assert r.token_times_s[0] - r.arrival_time_s >= 0  # TTFT
        assert r.finish_time_s == r.token_times_s[-1]
        assert r.num_computed_tokens == r.num_prompt_tokens + r.num_output_tokens - 1


BASELINES = {
    "hf_generate": lambda model, reqs: run_hf_generate(model, reqs, batch_size=3, max_wait_s=0.05),
    "hf_generate_batch": lambda model, reqs: run_hf_generate_batch(model, reqs),
}


@pytest.mark.parametrize("name", list(BASELINES))
def test_greedy_matches_hf_generate(setup, name, capfd):
    model, prompts, refs = setup
    capfd.readouterr()
    reqs = make_requests(prompts)
    assert BASELINES[name](model, reqs) is reqs
    assert capfd.readouterr().err == ""  # no warnings, logs or progress bars
    for r, ref in zip(reqs, refs):
        assert r.output_token_ids == ref, r.request_id
        assert r.finish_reason == "length"
    check_stamps(reqs)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", list(BASELINES))
def test_eos_stops_unless_ignore_eos(name):
    """With EOS set to a token the greedy run emits mid-way, only the ignore_eos copy runs past it."""
    model, _ = load_model("tiny-random-llama")
    prompt = list(range(40, 52))
    ref = hf_reference(model, prompt, 10)
    k = next(i for i in range(2, 8) if ref[i] not in ref[:i])  # first occurrence of the token, mid-way
    model.generation_config.eos_token_id = ref[k]
    reqs = [Request("ignore", prompt, 10, SamplingParams(ignore_eos=True)),
            Request("stop", prompt, 10, SamplingParams())]
    BASELINES[name](model, reqs)
    assert reqs[0].output_token_ids == ref and reqs[0].finish_reason == "length"
    assert reqs[1].output_token_ids == ref[:k + 1] and reqs[1].finish_reason == "stop"
    assert reqs[1].eos_token_ids == (ref[k],)
    check_stamps(reqs)


def test_static_batches_one_per_request_when_spaced(setup):
    model, prompts, refs = setup
    reqs = make_requests(prompts, gap_s=100.0)  # far apart, no waiting: every request alone
    run_hf_generate(model, reqs, batch_size=8, max_wait_s=0.0)
    for r, ref in zip(reqs, refs):
        assert r.output_token_ids == ref
        assert r.first_scheduled_time_s == r.arrival_time_s  # idle gaps are jumped, not slept
    check_stamps(reqs)


def test_static_batch_formation(setup):
    model, prompts, refs = setup
    # all at t=0, batch_size 2: [r0 r1] [r2 r3] [r4]; a batch starts after the previous one finished
    reqs = make_requests(prompts, gap_s=0.0)
    run_hf_generate(model, reqs, batch_size=2, max_wait_s=5.0)
    assert [r.output_token_ids for r in reqs] == refs
    starts = [r.first_scheduled_time_s for r in reqs]
    assert starts[0] == starts[1] == 0.0 and starts[2] == starts[3] and starts[4] > starts[3]
    assert starts[2] >= max(r.finish_time_s for r in reqs[:2])
    assert starts[4] >= max(r.finish_time_s for r in reqs[2:4])
    # a request that finishes early in its batch finishes at its own last token, before the others
    assert reqs[1].finish_time_s < reqs[0].finish_time_s  # 3 vs 8 new tokens
    # a partial batch waits for the oldest request's max_wait_s, gathering later arrivals
    late = [Request("a", prompts[0], 2, GREEDY, arrival_time_s=0.0),
            Request("b", prompts[1], 2, GREEDY, arrival_time_s=0.5)]
    run_hf_generate(model, late, batch_size=8, max_wait_s=1.0)
    assert late[0].first_scheduled_time_s == late[1].first_scheduled_time_s == 1.0


@pytest.mark.parametrize("name", list(BASELINES))
def test_restores_attention_implementation(name):
    model, _ = load_model("tiny-random-llama")
    model.set_attn_implementation("eager")
    BASELINES[name](model, [Request("a", [5, 6, 7], 2, GREEDY)])
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("name", list(BASELINES))
def test_sampled_requests_run(setup, name, capfd):
    model, prompts, _ = setup
    sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3, ignore_eos=True)
    capfd.readouterr()
    reqs = BASELINES[name](model, make_requests(prompts[:3], sampling=sampling))
    assert capfd.readouterr().err == ""
    assert [r.num_output_tokens for r in reqs] == MAX_NEW[:3]
    check_stamps(reqs)
    if name == "hf_generate":  # one seed per batch: the same trace samples the same tokens
        again = BASELINES[name](model, make_requests(prompts[:3], sampling=sampling))
        assert [r.output_token_ids for r in again] == [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("run", [run_hf_generate, run_hf_generate_batch])
def test_rejects_bad_input(setup, run):
    model, prompts, _ = setup
    with pytest.raises(ValueError, match="empty"):
        run(model, [])
    with pytest.raises(ValueError, match="duplicate"):
        run(model, [Request("a", [5], 1), Request("a", [6], 1)])
    used = Request("u", [5], 1)
    used.output_token_ids = [7]
    with pytest.raises(ValueError, match="already ran"):
        run(model, [used])
    with pytest.raises(ValueError, match="max_model_len"):
        run(model, [Request("long", [5] * 500, 100)])


def test_static_rejects_bad_batch_settings(setup):
    model, prompts, _ = setup
    with pytest.raises(ValueError, match="batch_size"):
        run_hf_generate(model, make_requests(prompts), batch_size=0)
    with pytest.raises(ValueError, match="max_wait_s"):
        run_hf_generate(model, make_requests(prompts), max_wait_s=-1)
