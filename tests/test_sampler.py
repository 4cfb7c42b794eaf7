"""Sampling: filters and per-request seeded generators."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch.kernels import cpu_decode_layer
from minibatch.request import SamplingParams
from minibatch.runner.sampler import Sampler, filter_logits


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 5.0])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_k=2)))
    assert kept.tolist() == [False, True, False, False, True]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.75)))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.75 <= 0.8


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 50), st.floats(0.0, 1.0, exclude_min=True), st.integers(0, 2**31 - 1))  # subnormal top_p too
def test_filters_never_remove_the_argmax(top_k, top_p, seed):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(seed))
    out = filter_logits(logits, SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p))
    assert torch.isfinite(out[logits.argmax()])
    assert int(torch.isfinite(out).sum()) <= top_k


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    sp = SamplingParams(temperature=1.0, seed=7)
    a = [Sampler().sample_batch(["x"], logits[i : i + 1], [sp])["x"] for i in range(3)]
    b = [Sampler().sample_batch(["x"], logits[i : i + 1], [sp])["x"] for i in range(3)]
    assert a == b
    g = Sampler().sample_batch(["a", "b", "c"], logits, [SamplingParams()] * 3)
    assert list(g.values()) == logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match="equally many"):  # a row left over would be dropped silently
        Sampler().sample_batch(["a", "b"], logits, [SamplingParams()] * 2)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 12), st.sampled_from([7, 1024, 4095, 4096, 5000, 32000, 49152]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.integers(0, 2**31 - 1),
       st.sampled_from(["none", "ties", "nan", "inf", "-inf", "flat"]), st.booleans())
def test_greedy_tokens_is_argmax(rows, vocab, dtype, seed, special, kernel):
    """The sampler's greedy argmax, both ways (``kernel``: the one-pass C++ kernel where it builds with AVX-512, else
    the two-pass torch path), returns torch.argmax's indices: the first of tied maxima (also across and at chunk and
    vector edges, and in the last, shorter chunk), the first NaN, +inf, rows all -inf or all equal; also on a
    non-contiguous view (which the kernel leaves to the torch path)."""
    from minibatch.runner.sampler import ARGMAX_CHUNK, greedy_tokens

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    spots = torch.randint(0, vocab, (rows, 3), generator=g).tolist()
    for r, cols in enumerate(spots):
        cols += [c for c in (ARGMAX_CHUNK - 1, ARGMAX_CHUNK, vocab - 1) if c < vocab]  # chunk edges, the last entry
        if special == "ties":
            logits[r, cols] = 9.0
        elif special in ("nan", "inf"):
            logits[r, cols[:2]] = float(special)
        elif special == "-inf":
            logits[r] = float("-inf")
        elif special == "flat":
            logits[r] = 0.5
    strided = logits.repeat(1, 2)[:, ::2]  # a non-contiguous view of the same shape
    module = cpu_decode_layer.KERNEL.module if kernel and cpu_decode_layer.available() else None
    with mock.patch.object(cpu_decode_layer.KERNEL, "module", module):  # None: the torch path
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
        assert torch.equal(greedy_tokens(strided), strided.argmax(-1))
        if module is not None and module.greedy_argmax_vectorized() and dtype != torch.float16:
            assert cpu_decode_layer.greedy_argmax(logits) is not None  # the kernel took it
