"""The C++ paged prefill kernel (minibatch/kernels/cpu_paged_prefill.cpp, bf16 with AVX512-BF16) against float32
causal attention computed from the same bf16 inputs, over the class of inputs the engine passes: GQA groups, head
sizes, block sizes, sliding windows, prefills with nothing cached and chunks that extend a cached context, one query
row up to several chunks of 64 keys, several prefills in one call beside rows it must leave alone; its refusals; and
the ``cpp`` backend running it in bf16 engines under the logprob-close rule. Skipped where the CPU has no
AVX512-BF16 (the backend keeps ``sdpa``'s prefill path there)."""

import pytest
import torch
import torch.nn.functional as F

from minibatch.kernels import cpu_prefill
from minibatch.kernels.cpp_build import compiler_available
from minibatch.kernels.cpu_bf16_linear import cpu_has_avx512_bf16

pytestmark = pytest.mark.skipif(not (compiler_available() and cpu_has_avx512_bf16()),
                                reason="the prefill kernel needs a C++ compiler and a CPU with AVX512-BF16")


def reference(q, k, v, ctx, scale, window):
    """float32 causal attention of q (q_len, H, D) at positions ctx.. over k, v (seq_len, H_kv, D)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    pos, key = torch.arange(ctx, ctx + q.shape[0])[:, None], torch.arange(k.shape[0])[None, :]
    seen = (key <= pos) & ((pos - key < window) if window else True)
    s = torch.einsum("thd,jhd->htj", q.float(), k) * scale
    return torch.einsum("htj,jhd->thd", s.masked_fill(~seen, float("-inf")).softmax(-1), v)


def run_case(num_heads, num_kv_heads, head_dim, block_size, spans, window, seed=0):
    """spans: (cached tokens, new tokens) per prefill. Returns (our max error, torch bf16 SDPA's max error)."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(c + n) // block_size) for c, n in spans)
    num_blocks = (len(spans) + 1) * max_blocks + 7
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).bfloat16()
                        for _ in range(2))
    tables = torch.randperm(num_blocks, generator=g)[: (len(spans) + 1) * max_blocks].view(-1, max_blocks)
    rows, start = [], 3  # three rows before the first prefill, and one between each: not the kernel's to write
    for i, (c, n) in enumerate(spans):
        rows.append([start, n, c + n, i + 1])  # table rows from 1: the span says which
        start += n + 1
    q = (3 * torch.randn(start, num_heads, head_dim, generator=g)).bfloat16()
    out = torch.full_like(q, 7.0)
    scale = head_dim ** -0.5
    cpu_prefill.paged_prefill(q, k_cache, v_cache, tables, torch.tensor(rows), scale, window, out)
    written = torch.zeros(start, dtype=torch.bool)
    ours = theirs = 0.0
    for first, n, seq_len, row in rows:
        written[first:first + n] = True
        blocks = tables[row, : -(-seq_len // block_size)]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        ref = reference(q[first:first + n], k, v, seq_len - n, scale, window)
        ours = max(ours, (out[first:first + n].float() - ref).abs().max().item())
        pos, key = torch.arange(seq_len - n, seq_len)[:, None], torch.arange(seq_len)[None, :]
        seen = (key <= pos) & ((pos - key < window) if window else True)
        sdpa = F.scaled_dot_product_attention(q[first:first + n].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], attn_mask=seen, scale=scale, enable_gqa=True)
        theirs = max(theirs, (sdpa[0].transpose(0, 1).float() - ref).abs().max().item())
    assert (out[~written] == 7.0).all()  # rows outside the spans untouched
    return ours, theirs


# (cached, new) spans: nothing cached, chunks extending a cache, one new token, contexts ending on, just before and
# just after a 64-key chunk, several chunks
SPANS = [((0, 100), (50, 30)), ((0, 1), (0, 64), (63, 1), (0, 65), (130, 70)), ((0, 200),), ((191, 2), (5, 128))]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 128, 8), (8, 2, 32, 32), (12, 3, 80, 1), (8, 1, 16, 48), (4, 2, 256, 16)])
@pytest.mark.parametrize("spans", range(len(SPANS)))
@pytest.mark.parametrize("window", [None, 5, 70])
def test_matches_float32_attention_as_closely_as_torch_bf16(num_heads, num_kv_heads, head_dim, block_size, spans,
                                                              window):
    ours, theirs = run_case(num_heads, num_kv_heads, head_dim, block_size, SPANS[spans], window, seed=spans)
    assert ours <= 2e-2 and ours <= 1.5 * theirs + 2e-3, (ours, theirs)


def test_refuses_inputs_outside_its_contract():
    k_cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(10, 4, 64, dtype=torch.bfloat16)
    tables = torch.tensor([[0, 1, 2, 3]])

    def call(q=q, spans=((0, 10, 10, 0),), tables=tables, cache=k_cache, out=None):
        out = torch.empty_like(q) if out is None else out
        cpu_prefill.paged_prefill(q, cache, cache, tables, torch.tensor(spans), 0.125, None, out)

    call()
    for spans, what in ((((5, 10, 10, 0),), "span 0"), (((0, 10, 9, 0),), "span 0"), (((0, 10, 65, 0),), "span 0"),
                        (((0, 10, 10, 1),), "span 0")):
        with pytest.raises(RuntimeError, match=what):
            call(spans=spans)
    with pytest.raises(RuntimeError, match="block id 9 outside the cache"):
        call(tables=torch.tensor([[9, 1, 2, 3]]))
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        call(q=torch.zeros(10, 4, 24, dtype=torch.bfloat16), cache=torch.zeros(4, 16, 2, 24, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="q must be"):
        call(q=q.float())
    with pytest.raises(RuntimeError, match="out must be"):
        call(out=torch.empty(10, 64, 4, dtype=torch.bfloat16).transpose(1, 2))
    assert cpu_prefill.supports(k_cache) and not cpu_prefill.supports(k_cache.float())
    assert not cpu_prefill.supports(torch.zeros(4, 16, 2, 24, dtype=torch.bfloat16))  # head_dim 24


@pytest.mark.parametrize("model_type", ["llama", "mistral"])  # mistral: a sliding window shorter than the prompts
def test_bf16_engines_running_it_are_logprob_close(model_type, monkeypatch):
    """Tiny random models in bf16 under paged (whole prompts), chunked (chunks extending a cached context),
    paged_prefix (prompts sharing a cached prefix) and spec_ngram (the verification of drafted tokens runs as a short
    prefill): the ``cpp`` backend calls the kernel for every prefill and passes the bf16 rule against HF generate;
    the same engines with the kernel's output zeroed fail it."""
    from architectures import build_tiny_model, support_requests

    from minibatch import ModelRunner, Request, SamplingParams, SimClock, make_engine
    from minibatch.equivalence import check_outputs
    from minibatch.reference import reference_outputs
    from minibatch.runner.backends import cpp_paged

    model = build_tiny_model(model_type).to(torch.bfloat16)
    shared = support_requests(model)[0].prompt_token_ids[:8]  # paged_prefix: a prefix two prompts share
    requests = [Request(r.request_id, shared + r.prompt_token_ids[8:] if i == 1 else r.prompt_token_ids,
                        r.max_new_tokens, SamplingParams(ignore_eos=True, logprobs=5))
                for i, r in enumerate(support_requests(model))]
    refs = reference_outputs(model, requests, logprobs=5)
    # the modules' path: the fused layers (which call the same kernel from C++) give its logits bit for bit
    # (tests/test_fused_layers.py)
    runner = ModelRunner(model, attention_backend="cpp", fuse_decode_layers=False)
    calls = []
    kernel = cpp_paged.cpu_prefill.paged_prefill

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(cpp_paged.cpu_prefill, "paged_prefill", counted)
    options = {"paged": dict(block_size=4), "chunked": dict(block_size=4, max_num_batched_tokens=8),
               "paged_prefix": dict(block_size=4), "spec_ngram": dict(block_size=4)}
    for policy, extra in options.items():
        engine = make_engine(policy, runner, SimClock(), config={"n_slots": 512}, **extra)
        done = engine.generate([r.copy() for r in requests])
        report = check_outputs(done, refs, "logprob-close")
        assert report["passed"] is True, (policy, report)
    assert len(calls) >= 3 * model.config.num_hidden_layers

    def zeroed(*args):
        return kernel(*args).zero_()

    monkeypatch.setattr(cpp_paged.cpu_prefill, "paged_prefill", zeroed)
    done = make_engine("paged", runner, SimClock(), config={"n_slots": 512}, block_size=4).generate(
        [r.copy() for r in requests])
    assert check_outputs(done, refs, "logprob-close")["passed"] is False
