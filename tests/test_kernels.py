"""The paged-KV Triton kernels against their torch references and a naive loop written out by hand.

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, numpy on
CPU tensors), so shapes stay small. With CUDA the same tests also run on the GPU, plus bf16
(the interpreter cannot do bf16 tl.dot).

The cache is filled with NaN except the slots that hold real context: a kernel that reads a
wrong slot, a wrong layer or past the end of a sequence returns NaN and fails loudly.
"""

import os

import torch

if not torch.cuda.is_available():
    # Before minibatch is imported: it imports transformers -> torch._dynamo -> triton, and the
    # interpreter only works if the variable was set before triton's first import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

import minibatch.kernels as kernels  # noqa: E402
from minibatch.kernels import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    store_kv,
    store_kv_ref,
)

_cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=_cuda_only)]
FP32_TOL = dict(atol=1e-4, rtol=2e-5)
LOW_PRECISION_TOL = dict(atol=2e-2, rtol=2e-2)
# The interpreter runs fp16 correctly but not bf16 tl.dot (see paged_prefill_attention).
LOW_PRECISION = [
    ("cpu", torch.float16),
    pytest.param("cuda", torch.float16, marks=_cuda_only),
    pytest.param("cuda", torch.bfloat16, marks=_cuda_only),
]
LAYER, NUM_LAYERS = 1, 2  # write/read layer 1 of 2, so layer indexing is exercised


def skip_unless_kernels_run_on(device: str) -> None:
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    if device == "cpu" and not kernels.IS_INTERPRETED:
        pytest.skip("kernels are compiled for the GPU; CPU tensors need TRITON_INTERPRET=1")


# ---- test data ---------------------------------------------------------------------------------


def make_paged_context(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, generator):
    """A NaN-filled cache holding each request's random context in shuffled, non-contiguous blocks.

    Returns kv_cache, block_tables (num_reqs, max_blocks) int32 with garbage past each request's
    blocks, and the per-request contexts [(k, v)] with k, v: (seq_len, num_kv_heads, head_dim).
    """
    blocks_needed = [-(-n // block_size) for n in seq_lens]  # ceil
    num_blocks = sum(blocks_needed) + 3  # a few blocks nobody owns
    free = torch.randperm(num_blocks, generator=generator).tolist()  # shuffled physical block ids
    max_blocks = max(blocks_needed) + 1  # at least one padding entry per row
    block_tables = torch.full((len(seq_lens), max_blocks), num_blocks + 1000, dtype=torch.int32)  # garbage
    kv_cache = torch.full((NUM_LAYERS, 2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    contexts = []
    for r, seq_len in enumerate(seq_lens):
        block_tables[r, : blocks_needed[r]] = torch.tensor([free.pop() for _ in range(blocks_needed[r])])
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        for pos in range(seq_len):  # position -> (physical block, offset), written out by hand
            block = int(block_tables[r, pos // block_size])
            kv_cache[LAYER, 0, block, pos % block_size] = k[pos]
            kv_cache[LAYER, 1, block, pos % block_size] = v[pos]
        contexts.append((k.to(device), v.to(device)))
    return kv_cache.to(device), block_tables.to(device), contexts


def naive_attention(q, k, v, scale):
    """q: (q_len, H, D) at the last q_len positions of a context k, v: (seq_len, H_kv, D). Loops, fp64."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for h in range(num_heads):
        kv_h = h // (num_heads // num_kv_heads)  # GQA: query head h reads KV head h // group
        for i in range(q_len):
            visible = seq_len - q_len + i + 1  # causal: keys 0 .. own position
            w = torch.softmax((k[:visible, kv_h].double() @ q[i, h].double()) * scale, dim=0)
            out[i, h] = w @ v[:visible, kv_h].double()
    return out.to(q.dtype)


# (block_size, num_heads, num_kv_heads, head_dim): block sizes 1, 3 (not a power of two), 16;
# GQA and MHA; head_dim 16 and 64.
ATTENTION_CASES = [
    (1, 4, 2, 16),
    (3, 4, 2, 16),
    (3, 2, 2, 64),
    (16, 2, 2, 16),
    (16, 4, 2, 64),
]


def decode_inputs(block_size, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    # 1 token; exactly one block; 32 = one full decode tile; ragged; 37 crosses tiles (BLOCK_N = 32)
    seq_lens = [1, block_size, 32, 2 * block_size + 1, 37]
    kv_cache, block_tables, contexts = make_paged_context(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, device, g
    )
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype).to(device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, kv_cache, block_tables, seq_lens_t, contexts, head_dim**-0.5


def prefill_inputs(block_size, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    # (seq_len, q_len): fresh prefill over two BLOCK_M=16 query tiles; decode rows mixed in;
    # a chunk after 32 cached tokens; a chunk ending exactly at a block boundary; a 1-token prompt.
    reqs = [(20, 20), (9, 1), (37, 5), (2 * block_size + 2, 3), (1, 1), (17, 1)]
    seq_lens = [s for s, _ in reqs]
    kv_cache, block_tables, contexts = make_paged_context(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, device, g
    )
    q_lens = [n for _, n in reqs]
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype).to(device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, kv_cache, block_tables, seq_lens_t, cu_seqlens_q, contexts, head_dim**-0.5


# ---- store_kv ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_writes_its_slots_and_nothing_else(device, block_size, slot_dtype):
    skip_unless_kernels_run_on(device)
    g = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 8, 2, 16, 7  # 5 real tokens, >= 3 slots untouched
    kv_cache = torch.randn(NUM_LAYERS, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(device)
    # key/value as views into a wider projection output: token stride != num_kv_heads * head_dim
    kv_proj = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=g).to(device)
    key, value = kv_proj[:, :num_kv_heads], kv_proj[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[1, 4]] = -1  # padding tokens
    slot_mapping = slots.to(slot_dtype).to(device)

    expected = kv_cache.clone()
    for i, slot in enumerate(slots.tolist()):  # written out by hand: slot = block * block_size + offset
        if slot >= 0:
            expected[LAYER, 0, slot // block_size, slot % block_size] = key[i]
            expected[LAYER, 1, slot // block_size, slot % block_size] = value[i]

    out_kernel = kv_cache.clone()
    assert store_kv(out_kernel, LAYER, key, value, slot_mapping) is None
    out_ref = kv_cache.clone()
    store_kv_ref(out_ref, LAYER, key, value, slot_mapping)
    torch.testing.assert_close(out_kernel, expected, atol=0, rtol=0)  # a copy: bit-exact
    torch.testing.assert_close(out_ref, expected, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_casts_to_cache_dtype_and_skips_all_padding(device):
    skip_unless_kernels_run_on(device)
    g = torch.Generator().manual_seed(0)
    kv_cache = torch.zeros(NUM_LAYERS, 2, 3, 3, 1, 16, dtype=torch.float16, device=device)
    key, value = torch.randn(2, 2, 1, 16, generator=g).to(device)  # fp32 into an fp16 cache
    store_kv(kv_cache, LAYER, key, value, torch.tensor([5, 0], device=device))
    torch.testing.assert_close(kv_cache[LAYER, 0, 1, 2], key[0].half(), atol=0, rtol=0)  # slot 5 = block 1, offset 2
    torch.testing.assert_close(kv_cache[LAYER, 1, 0, 0], value[1].half(), atol=0, rtol=0)
    assert kv_cache[LAYER].count_nonzero() == 2 * 2 * 16

    before = kv_cache.clone()
    store_kv(kv_cache, LAYER, key, value, torch.tensor([-1, -1], device=device))
    assert torch.equal(kv_cache, before)


# ---- decode ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_decode_reference_matches_naive(case):
    q, kv_cache, block_tables, seq_lens, contexts, scale = decode_inputs(*case, torch.float32, "cpu")
    out = paged_decode_attention_ref(q, kv_cache, LAYER, block_tables, seq_lens, scale)
    for i, (k, v) in enumerate(contexts):
        torch.testing.assert_close(out[i : i + 1], naive_attention(q[i : i + 1], k, v, scale), **FP32_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_decode_kernel_matches_reference_and_naive(device, case):
    skip_unless_kernels_run_on(device)
    q, kv_cache, block_tables, seq_lens, contexts, scale = decode_inputs(*case, torch.float32, device)
    out = paged_decode_attention(q, kv_cache, LAYER, block_tables, seq_lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, paged_decode_attention_ref(q, kv_cache, LAYER, block_tables, seq_lens, scale),
                               **FP32_TOL)
    for i, (k, v) in enumerate(contexts):
        torch.testing.assert_close(out[i : i + 1], naive_attention(q[i : i + 1], k, v, scale), **FP32_TOL)


@pytest.mark.parametrize(("device", "dtype"), LOW_PRECISION)
@pytest.mark.parametrize("case", [ATTENTION_CASES[1], ATTENTION_CASES[4]])
def test_decode_kernel_low_precision(device, dtype, case):
    skip_unless_kernels_run_on(device)
    q, kv_cache, block_tables, seq_lens, _, scale = decode_inputs(*case, dtype, device)
    out = paged_decode_attention(q, kv_cache, LAYER, block_tables, seq_lens, scale)
    assert out.dtype == dtype
    ref = paged_decode_attention_ref(q, kv_cache, LAYER, block_tables, seq_lens, scale)  # fp32 math inside
    torch.testing.assert_close(out, ref, **LOW_PRECISION_TOL)


# ---- prefill -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_prefill_reference_matches_naive(case):
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, contexts, scale = prefill_inputs(*case, torch.float32, "cpu")
    out = paged_prefill_attention_ref(q, kv_cache, LAYER, block_tables, seq_lens, cu_seqlens_q, scale)
    cu = cu_seqlens_q.tolist()
    for r, (k, v) in enumerate(contexts):
        torch.testing.assert_close(out[cu[r] : cu[r + 1]], naive_attention(q[cu[r] : cu[r + 1]], k, v, scale),
                                   **FP32_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_prefill_kernel_matches_reference_and_naive(device, case):
    skip_unless_kernels_run_on(device)
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, contexts, scale = prefill_inputs(*case, torch.float32, device)
    out = paged_prefill_attention(q, kv_cache, LAYER, block_tables, seq_lens, cu_seqlens_q, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = paged_prefill_attention_ref(q, kv_cache, LAYER, block_tables, seq_lens, cu_seqlens_q, scale)
    torch.testing.assert_close(out, ref, **FP32_TOL)
    cu = cu_seqlens_q.tolist()
    for r, (k, v) in enumerate(contexts):
        torch.testing.assert_close(out[cu[r] : cu[r + 1]], naive_attention(q[cu[r] : cu[r + 1]], k, v, scale),
                                   **FP32_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_with_one_token_per_request_equals_decode(device):
    skip_unless_kernels_run_on(device)
    q, kv_cache, block_tables, seq_lens, _, _ = decode_inputs(3, 4, 2, 16, torch.float32, device)
    cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=device)
    prefill = paged_prefill_attention(q, kv_cache, LAYER, block_tables, seq_lens, cu_seqlens_q, 0.3, max_q_len=1)
    decode = paged_decode_attention(q, kv_cache, LAYER, block_tables, seq_lens, 0.3)
    torch.testing.assert_close(prefill, decode, **FP32_TOL)


@pytest.mark.parametrize(("device", "dtype"), LOW_PRECISION)
@pytest.mark.parametrize("case", [ATTENTION_CASES[1], ATTENTION_CASES[4]])
def test_prefill_kernel_low_precision(device, dtype, case):
    skip_unless_kernels_run_on(device)
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, _, scale = prefill_inputs(*case, dtype, device)
    out = paged_prefill_attention(q, kv_cache, LAYER, block_tables, seq_lens, cu_seqlens_q, scale)
    assert out.dtype == dtype
    ref = paged_prefill_attention_ref(q, kv_cache, LAYER, block_tables, seq_lens, cu_seqlens_q, scale)
    torch.testing.assert_close(out, ref, **LOW_PRECISION_TOL)  # P is rounded to q's dtype for P @ V


def test_interpreted_prefill_refuses_bf16():
    if not kernels.IS_INTERPRETED:
        pytest.skip("kernels are compiled, bf16 is supported")
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, _, scale = prefill_inputs(3, 4, 2, 16, torch.bfloat16, "cpu")
    with pytest.raises(NotImplementedError, match="bfloat16"):
        paged_prefill_attention(q, kv_cache, LAYER, block_tables, seq_lens, cu_seqlens_q, scale)


# ---- argument checks and missing triton --------------------------------------------------------


def test_wrappers_reject_bad_shapes():
    kv_cache = torch.zeros(NUM_LAYERS, 2, 4, 3, 2, 16)
    block_tables = torch.zeros(1, 2, dtype=torch.int32)
    seq_lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of"):  # 3 query heads over 2 KV heads
        paged_decode_attention_ref(torch.zeros(1, 3, 16), kv_cache, 0, block_tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="layer"):
        paged_decode_attention_ref(torch.zeros(1, 4, 16), kv_cache, 2, block_tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_ref(kv_cache, 0, torch.zeros(2, 2, 16), torch.zeros(2, 2, 16), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="kv_cache"):
        store_kv(kv_cache[0], 0, torch.zeros(2, 2, 16), torch.zeros(2, 2, 16), torch.zeros(2, dtype=torch.long))


def test_without_triton_references_work_and_kernels_raise(monkeypatch):
    """Re-import the package as if triton were missing, then restore it."""
    # the package first (it imports triton), then the kernel modules, then the package again so its
    # names point at the re-executed functions
    package = "minibatch.kernels"
    names = [f"{package}.triton_probe", f"{package}.store_kv", f"{package}.paged_attention", package]
    try:
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
            for name in names:
                importlib.reload(sys.modules[name])
            no_triton = sys.modules["minibatch.kernels"]
            assert not no_triton.HAS_TRITON
            kv_cache = torch.zeros(NUM_LAYERS, 2, 2, 3, 1, 16)
            key = torch.ones(1, 1, 16)
            no_triton.store_kv_ref(kv_cache, 0, key, key, torch.tensor([4]))
            assert kv_cache[0, 0, 1, 1].eq(1).all()
            with pytest.raises(RuntimeError, match="triton could not be imported"):
                no_triton.store_kv(kv_cache, 0, key, key, torch.tensor([4]))
            with pytest.raises(RuntimeError, match="triton could not be imported"):
                no_triton.paged_decode_attention(
                    torch.zeros(1, 1, 16), kv_cache, 0, torch.zeros(1, 1, dtype=torch.int32),
                    torch.ones(1, dtype=torch.int32), 1.0,
                )
    finally:
        for name in names:
            importlib.reload(sys.modules[name])
    assert sys.modules["minibatch.kernels"].HAS_TRITON == (importlib.util.find_spec("triton") is not None)


def test_compiled_kernels_refuse_cpu_tensors(monkeypatch):
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setattr("minibatch.kernels.triton_probe.IS_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.require_triton(torch.device("cpu"))
