"""The C++ paged prefill kernel (minibatch/kernels/cpu_paged_prefill.cpp: bf16 with AVX512-BF16, float32 with AVX2 and
FMA or AVX-512) against float64 causal attention computed from the same inputs, over the class of inputs the engine
passes: GQA groups, head sizes, block sizes, sliding windows, prefills with nothing cached and chunks that extend a
cached context, one query row up to several chunks of 64 keys, several prefills in one call beside rows it must leave
alone; its refusals; the float32 path at AVX2's width on a CPU with AVX-512 too; and the ``cpp`` backend running it in
engines, bf16 under the logprob-close rule and float32 token-exact with HF generate. Each dtype's tests are skipped
where the CPU lacks its instructions (the backend keeps ``sdpa``'s prefill path there)."""

import pytest
import torch
import torch.nn.functional as F

from minibatch.kernels import cpu_prefill
from minibatch.kernels.cpp_build import compiler_available
from minibatch.kernels.cpu_bf16_linear import cpu_has_avx512_bf16
from minibatch.machine import cpu_isa

ISA = cpu_isa().split()
HAS = {torch.bfloat16: compiler_available() and cpu_has_avx512_bf16(),
       torch.float32: compiler_available() and ("avx512f" in ISA or {"avx2", "fma"} <= set(ISA))}
needs = {dtype: pytest.mark.skipif(not ok, reason=f"the prefill kernel's {dtype} path needs a C++ compiler and "
                                   + ("AVX512-BF16" if dtype == torch.bfloat16 else "AVX2 with FMA, or AVX-512"))
         for dtype, ok in HAS.items()}
DTYPES = [pytest.param(dtype, marks=needs[dtype], id=str(dtype).removeprefix("torch.")) for dtype in HAS]


def reference(q, k, v, ctx, scale, window):
    """float64 causal attention of q (q_len, H, D) at positions ctx.. over k, v (seq_len, H_kv, D)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    pos, key = torch.arange(ctx, ctx + q.shape[0])[:, None], torch.arange(k.shape[0])[None, :]
    seen = (key <= pos) & ((pos - key < window) if window else True)
    s = torch.einsum("thd,jhd->htj", q.double(), k) * scale
    return torch.einsum("htj,jhd->thd", s.masked_fill(~seen, float("-inf")).softmax(-1), v)


def run_case(num_heads, num_kv_heads, head_dim, block_size, spans, window, seed=0, dtype=torch.bfloat16):
    """spans: (cached tokens, new tokens) per prefill. Returns (our max error, torch SDPA's max error in dtype)."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(c + n) // block_size) for c, n in spans)
    num_blocks = (len(spans) + 1) * max_blocks + 7
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
                        for _ in range(2))
    tables = torch.randperm(num_blocks, generator=g)[: (len(spans) + 1) * max_blocks].view(-1, max_blocks)
    rows, start = [], 3  # three rows before the first prefill, and one between each: not the kernel's to write
    for i, (c, n) in enumerate(spans):
        rows.append([start, n, c + n, i + 1])  # table rows from 1: the span says which
        start += n + 1
    q = (3 * torch.randn(start, num_heads, head_dim, generator=g)).to(dtype)
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
        ours = max(ours, (out[first:first + n].double() - ref).abs().max().item())
        pos, key = torch.arange(seq_len - n, seq_len)[:, None], torch.arange(seq_len)[None, :]
        seen = (key <= pos) & ((pos - key < window) if window else True)
        sdpa = F.scaled_dot_product_attention(q[first:first + n].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], attn_mask=seen, scale=scale, enable_gqa=True)
        theirs = max(theirs, (sdpa[0].transpose(0, 1).double() - ref).abs().max().item())
    assert (out[~written] == 7.0).all()  # rows outside the spans untouched
    return ours, theirs


# (cached, new) spans: nothing cached, chunks extending a cache, one new token, contexts ending on, just before and
# just after a 64-key chunk, several chunks
SPANS = [((0, 100), (50, 30)), ((0, 1), (0, 64), (63, 1), (0, 65), (130, 70)), ((0, 200),), ((191, 2), (5, 128))]


SHAPES = [(9, 3, 64, 16), (4, 4, 128, 8), (8, 2, 32, 32), (12, 3, 80, 1), (8, 1, 16, 48), (4, 2, 256, 16)]


def close_enough(ours, theirs, dtype) -> bool:
    """bf16: within 2e-2 of float64 and 1.5x torch's bf16 SDPA's error (+2e-3); float32: within 1e-4 and 3x torch's
    float32 SDPA's (+1e-6; the kernel's sums run in another order, up to ~2.2x torch's error at head_dim 256)."""
    if dtype == torch.bfloat16:
        return ours <= 2e-2 and ours <= 1.5 * theirs + 2e-3
    return ours <= 1e-4 and ours <= 3 * theirs + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("spans", range(len(SPANS)))
@pytest.mark.parametrize("window", [None, 5, 70])
def test_matches_float64_attention_as_closely_as_torch(num_heads, num_kv_heads, head_dim, block_size, spans, window,
                                                       dtype):
    ours, theirs = run_case(num_heads, num_kv_heads, head_dim, block_size, SPANS[spans], window, spans, dtype)
    assert close_enough(ours, theirs, dtype), (ours, theirs)


@needs[torch.float32]
@pytest.mark.skipif("avx512f" not in ISA, reason="the CPU's own build is already AVX2's width")
def test_float32_at_avx2_width_on_an_avx512_cpu(monkeypatch):
    """Laptops without AVX-512 run the float32 path on 8 lanes with 16 registers (another register blocking): built
    here without AVX-512 (``-mno-avx512f``), it must hold to the same bound on every head size and span set."""
    from minibatch.kernels import cpp_build

    module = cpp_build.build(cpu_prefill.SOURCE, ("-mno-avx512f",))
    assert module.prefill_available("float32") and not module.prefill_available("bfloat16")
    monkeypatch.setattr(cpu_prefill.KERNEL, "module", module)
    for shape in SHAPES:
        for i, spans in enumerate(SPANS):
            for window in (None, 5, 70):
                ours, theirs = run_case(*shape, spans, window, i, torch.float32)
                assert close_enough(ours, theirs, torch.float32), (shape, spans, window, ours, theirs)


@needs[torch.bfloat16]
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
        call(q=q.half())
    with pytest.raises(RuntimeError, match="the caches must be"):
        call(q=q.float())
    with pytest.raises(RuntimeError, match="out must be"):
        call(out=torch.empty(10, 64, 4, dtype=torch.bfloat16).transpose(1, 2))
    assert cpu_prefill.supports(k_cache) and not cpu_prefill.supports(k_cache.half())
    assert cpu_prefill.supports(k_cache.float()) is HAS[torch.float32]
    assert not cpu_prefill.supports(torch.zeros(4, 16, 2, 24, dtype=torch.bfloat16))  # head_dim 24


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", ["llama", "mistral"])  # mistral: a sliding window shorter than the prompts
def test_engines_running_it_pass_the_equivalence_rule(model_type, dtype, monkeypatch):
    """Tiny random models under paged (whole prompts), chunked (chunks extending a cached context), paged_prefix
    (prompts sharing a cached prefix) and spec_ngram (the verification of drafted tokens runs as a short prefill):
    the ``cpp`` backend calls the kernel for every prefill and passes the rule against HF generate (bf16:
    logprob-close; float32: token-exact); the same engines with the kernel's output zeroed fail it."""
    from architectures import build_tiny_model, support_requests

    from minibatch import ModelRunner, Request, SamplingParams, SimClock, make_engine
    from minibatch.equivalence import check_outputs
    from minibatch.reference import reference_outputs
    from minibatch.runner.backends import cpp_paged

    model = build_tiny_model(model_type).to(dtype)
    rule = "logprob-close" if dtype == torch.bfloat16 else "exact"
    shared = support_requests(model)[0].prompt_token_ids[:8]  # paged_prefix: a prefix two prompts share
    requests = [Request(r.request_id, shared + r.prompt_token_ids[8:] if i == 1 else r.prompt_token_ids,
                        r.max_new_tokens, SamplingParams(ignore_eos=True, logprobs=5))
                for i, r in enumerate(support_requests(model))]
    refs = reference_outputs(model, requests, logprobs=5)
    # the modules' path: in bf16 the fused layers (which call the same kernel from C++) give its logits bit for bit
    # (tests/test_fused_layers.py); in float32 they take no prefills
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
        report = check_outputs(done, refs, rule)
        assert report["passed"] is True, (policy, report)
    assert len(calls) >= 3 * model.config.num_hidden_layers

    def zeroed(*args):
        return kernel(*args).zero_()

    monkeypatch.setattr(cpp_paged.cpu_prefill, "paged_prefill", zeroed)
    done = make_engine("paged", runner, SimClock(), config={"n_slots": 512}, block_size=4).generate(
        [r.copy() for r in requests])
    assert check_outputs(done, refs, rule)["passed"] is False
