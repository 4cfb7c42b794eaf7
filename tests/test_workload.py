"""Tests for minibatch.workload (arrivals, length distributions, traces), minibatch.prompts and
minibatch.trace_io (save/load)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch.prompts import chat_prompt_ids, demo_prompts
from minibatch.request import Request, SamplingParams
from minibatch.trace_io import TRACE_FORMAT, load_trace, save_trace
from minibatch.workload import (
    SHAREGPT_LENGTHS_PATH,
    arrivals_at_zero,
    fixed_lengths,
    gamma_arrivals,
    load_sharegpt_lengths,
    make_trace,
    poisson_arrivals,
    sharegpt_lengths,
    uniform_lengths,
)


class CharTokenizer:
    """A tiny stand-in for an HF tokenizer: one id per character, no chat template."""

    chat_template = None

    def encode(self, text, add_special_tokens=True, **kwargs):  # kwargs: verbose, as HF tokenizers take
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def rng(seed=0):
    return np.random.default_rng(seed)


def inputs(r: Request):
    return (r.request_id, r.prompt_token_ids, r.max_new_tokens, r.sampling, r.arrival_time_s,
            r.prompt_text)


# ---------------------------------------------------------------- arrivals
def test_arrivals_at_zero():
    assert arrivals_at_zero(3) == [0.0, 0.0, 0.0]


def test_poisson_mean_gap():
    t = poisson_arrivals(5000, 4.0, rng())
    gaps = np.diff([0.0] + t)
    assert t == sorted(t) and t[0] > 0
    assert abs(gaps.mean() - 0.25) < 0.25 * 0.05  # std of mean ~ 1.4%
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.06  # exponential: cv = 1


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_cv(cv):
    t = gamma_arrivals(5000, 10.0, cv, rng(1))
    gaps = np.diff([0.0] + t)
    assert t == sorted(t)
    assert abs(gaps.mean() - 0.1) < 0.1 * 0.05 * cv
    assert abs(gaps.std() / gaps.mean() - cv) < 0.1 * cv


# ---------------------------------------------------------------- lengths
def test_fixed_lengths():
    assert fixed_lengths(2, 7, 9) == [(7, 9), (7, 9)]


def test_uniform_bounds_inclusive():
    pairs = uniform_lengths(2000, (3, 6), (1, 2), rng())
    assert {p for p, _ in pairs} == {3, 4, 5, 6}
    assert {o for _, o in pairs} == {1, 2}


def test_sharegpt_file_and_percentiles():
    data = json.loads(SHAREGPT_LENGTHS_PATH.read_text())
    assert data["num_pairs"] == len(data["prompt_lens"]) == len(data["output_lens"])
    prompts, outputs = load_sharegpt_lengths()
    pairs = sharegpt_lengths(20000, rng())
    for k, ref in ((0, prompts), (1, outputs)):
        got = np.array([pr[k] for pr in pairs])
        for q in (10, 50, 90):
            want = np.percentile(np.maximum(ref, 1), q)
            assert abs(np.percentile(got, q) - want) <= 0.1 * want + 2
    # Real chat: short prompts, a few hundred output tokens at the median.
    assert 10 <= np.median(prompts) <= 100 and 150 <= np.median(outputs) <= 400


def test_sharegpt_clipping():
    pairs = sharegpt_lengths(3000, rng(), max_prompt_len=64, max_output_len=32)
    ps, os_ = zip(*pairs)
    assert max(ps) == 64 and max(os_) == 32 and min(ps) >= 1 and min(os_) >= 1
    unclipped = sharegpt_lengths(3000, rng())  # same draws, then clipped
    assert [(min(p, 64), min(o, 32)) for p, o in unclipped] == [(max(p, 1), o) for p, o in pairs]


# ---------------------------------------------------------------- traces
def test_trace_deterministic_per_seed():
    kw = dict(arrival="gamma", rate_per_s=5.0, cv=3.0, lengths="sharegpt", max_prompt_len=256)
    a, b = make_trace(20, seed=7, **kw), make_trace(20, seed=7, **kw)
    assert [inputs(r) for r in a] == [inputs(r) for r in b]
    c = make_trace(20, seed=8, **kw)
    assert [inputs(r) for r in a] != [inputs(r) for r in c]


def test_trace_fields():
    tr = make_trace(12, arrival="poisson", rate_per_s=2.0, lengths="fixed", prompt_len=5,
                    output_len=3, vocab_size=50, seed=0)
    assert [r.request_id for r in tr] == [f"req-{i:03d}" for i in range(12)]
    assert all(r.num_prompt_tokens == 5 and r.max_new_tokens == 3 for r in tr)
    assert all(3 <= t < 50 for r in tr for t in r.prompt_token_ids)
    assert all(r.sampling.ignore_eos and r.prompt_text is None for r in tr)
    times = [r.arrival_time_s for r in tr]
    assert times == sorted(times) and times[0] > 0


def test_arrivals_independent_of_length_model():
    a = make_trace(10, lengths="fixed", seed=3)
    b = make_trace(10, lengths="uniform", seed=3)
    assert [r.arrival_time_s for r in a] == [r.arrival_time_s for r in b]


def test_trace_caps_apply_to_every_length_model():
    tr = make_trace(50, arrival="zero", lengths="uniform", prompt_range=(10, 100),
                    output_range=(10, 100), max_prompt_len=20, max_output_len=15)
    assert max(r.num_prompt_tokens for r in tr) == 20 and max(r.max_new_tokens for r in tr) == 15


def test_trace_with_tokenizer_uses_real_text():
    tok = CharTokenizer()
    tr = make_trace(3, arrival="zero", lengths="fixed", prompt_len=200, output_len=4,
                    tokenizer=tok)
    texts = demo_prompts()
    for i, r in enumerate(tr):
        assert r.num_prompt_tokens == 200
        assert r.prompt_text == tok.decode(r.prompt_token_ids)
        assert r.prompt_text.startswith(texts[i][:20])
    short = make_trace(1, arrival="zero", lengths="fixed", prompt_len=4, output_len=1,
                       tokenizer=tok, prompts=["hello world"])
    assert short[0].prompt_text == "hell"


def test_demo_prompts_and_chat_ids():
    ps = demo_prompts()
    assert len(ps) >= 12 and len(set(ps)) == len(ps)
    assert chat_prompt_ids(CharTokenizer(), "hi") == [ord("h"), ord("i")]


def test_save_load_roundtrip(tmp_path):
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, ignore_eos=True)
    tr = make_trace(6, arrival="gamma", cv=2.0, lengths="uniform", sampling=sp, seed=1)
    tr[0].prompt_text = "some text"
    path = tmp_path / "trace.json"
    save_trace(tr, path)
    assert json.loads(path.read_text())["format"] == TRACE_FORMAT
    back = load_trace(path)
    assert [inputs(r) for r in back] == [inputs(r) for r in tr]


def test_load_bad_files(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("not json")
    with pytest.raises(ValueError, match="not a JSON trace"):
        load_trace(p)
    p.write_text(json.dumps({"format": "other", "requests": []}))
    with pytest.raises(ValueError, match="format"):
        load_trace(p)
    p.write_text(json.dumps({"format": TRACE_FORMAT, "requests": [{"request_id": "a"}]}))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        load_trace(p)
    p.write_text(json.dumps({"format": TRACE_FORMAT, "requests": [
        {"request_id": "a", "prompt_token_ids": [1], "max_new_tokens": 0}]}))
    with pytest.raises(ValueError, match="max_new_tokens"):
        load_trace(p)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_requests=0), "num_requests"),
    (dict(rate_per_s=0.0), "rate_per_s"),
    (dict(rate_per_s=-1.0), "rate_per_s"),
    (dict(arrival="gamma", cv=0.0), "cv"),
    (dict(arrival="uniformly"), "arrival"),
    (dict(lengths="zipf"), "lengths"),
    (dict(lengths="fixed", prompt_len=0), "prompt_len"),
    (dict(lengths="fixed", output_len=0), "output_len"),
    (dict(lengths="uniform", prompt_range=(5, 2)), "prompt_range"),
    (dict(lengths="uniform", output_range=(0, 2)), "output_range"),
    (dict(max_prompt_len=0), "max_prompt_len"),
    (dict(max_output_len=0), "max_output_len"),
    (dict(vocab_size=3), "vocab_size"),
    (dict(prompts=["hi"]), "prompts"),
])
def test_bad_inputs_name_the_field(kwargs, field):
    kwargs = {"num_requests": 3, **kwargs}
    with pytest.raises(ValueError, match=field):
        make_trace(**kwargs)


def test_bad_arrival_name_lists_allowed():
    with pytest.raises(ValueError, match="poisson"):
        make_trace(2, arrival="nope")


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    arrival=st.sampled_from(["zero", "poisson", "gamma"]),
    rate=st.floats(0.01, 1000.0),
    cv=st.floats(0.1, 8.0),
    lengths=st.sampled_from(["sharegpt", "fixed", "uniform"]),
    lo=st.integers(1, 50),
    span=st.integers(0, 50),
    cap=st.one_of(st.none(), st.integers(1, 300)),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_valid_params(n, arrival, rate, cv, lengths, lo, span, cap, seed):
    tr = make_trace(n, arrival=arrival, rate_per_s=rate, cv=cv, lengths=lengths, prompt_len=lo,
                    output_len=lo + span, prompt_range=(lo, lo + span),
                    output_range=(lo, lo + span), max_prompt_len=cap, max_output_len=cap,
                    vocab_size=100, seed=seed)
    times = [r.arrival_time_s for r in tr]
    assert len(tr) == n and times == sorted(times) and min(times) >= 0
    for r in tr:
        assert 1 <= r.num_prompt_tokens and 1 <= r.max_new_tokens
        if cap is not None:
            assert r.num_prompt_tokens <= cap and r.max_new_tokens <= cap
        if lengths == "uniform":
            assert r.num_prompt_tokens <= lo + span and r.max_new_tokens <= lo + span
            assert r.num_prompt_tokens >= min(lo, cap or lo)
        assert all(3 <= t < 100 for t in r.prompt_token_ids)


def test_a_trace_is_described_by_its_latest_arrival_in_any_order():
    from minibatch.trace_io import describe_trace

    late, early = Request("a", [1, 2], 3, arrival_time_s=2.5), Request("b", [1], 4, arrival_time_s=0.5)
    assert describe_trace([late, early]) == "2 requests, 3 prompt + 7 output tokens, arrivals over 2.5 s"
