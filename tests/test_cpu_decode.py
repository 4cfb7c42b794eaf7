"""The C++ paged decode kernel (minibatch/kernels/cpu_paged_decode.cpp) against the eager reference decode
(``backends.compiled.paged_decode``: gather by table, masked fp32 softmax), over the class of shapes the engine
passes: dtypes, GQA groups, head sizes that are not a multiple of the vector width, block sizes, sliding windows,
contexts of one token up to a full table, few requests (one task per KV head) and many (one per request)."""

import pytest
import torch

from minibatch.kernels import cpu_decode
from minibatch.kernels.cpp_build import compiler_available
from minibatch.runner.backends.compiled import paged_decode as reference_decode

# skipped only without a compiler: where there is one, a kernel that does not build fails every test here
pytestmark = pytest.mark.skipif(not compiler_available(), reason="no C++ compiler to build the CPU decode kernel")

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,num_heads,num_kv_heads,head_dim,block_size", [
    (1, 4, 4, 16, 16), (3, 9, 3, 64, 16), (20, 8, 2, 24, 4), (7, 6, 1, 40, 1), (33, 4, 2, 128, 8)])
@pytest.mark.parametrize("window", [None, 5])
def test_matches_the_reference(dtype, n, num_heads, num_kv_heads, head_dim, block_size, window):
    g = torch.Generator().manual_seed(n * 31 + head_dim)
    max_blocks, num_blocks = 12, 500
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
                        for _ in range(2))
    tables = torch.randperm(num_blocks, generator=g)[: n * max_blocks].view(n, max_blocks)
    lens = torch.randint(1, max_blocks * block_size + 1, (n,), generator=g)
    lens[0] = max_blocks * block_size  # a full table
    if n > 1:
        lens[1] = 1  # one token of context
    q = torch.randn(n, num_heads, head_dim, generator=g).to(dtype)
    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, window)
    ref = reference_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, window)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - ref.float()).abs().max() <= TOLERANCE[dtype]


# shapes whose bf16 scores run on AMX tiles where the CPU has them (block_size a multiple of 16, head_dim of 64 or
# 128, at most 16 query heads per KV head): few requests (one KV head per task) and many (all of them, up to 32
# query heads per task), windows whose first 16-position chunk starts before the window, contexts ending mid-chunk;
# 1 to 16 query heads per KV head
@pytest.mark.parametrize("n,num_heads,num_kv_heads,head_dim,block_size", [
    (2, 9, 3, 64, 16), (9, 9, 3, 64, 16), (6, 8, 2, 128, 32), (5, 32, 2, 64, 16), (3, 16, 1, 128, 48),
    (8, 4, 4, 64, 16), (6, 10, 2, 64, 16), (7, 6, 2, 128, 16)])
@pytest.mark.parametrize("window", [None, 21])
def test_bf16_tile_scores_match_the_reference(n, num_heads, num_kv_heads, head_dim, block_size, window):
    g = torch.Generator().manual_seed(n * 7 + num_heads)
    max_blocks, num_blocks = 9, 200
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).bfloat16()
                        for _ in range(2))
    tables = torch.randperm(num_blocks, generator=g)[: n * max_blocks].view(n, max_blocks)
    lens = torch.randint(1, max_blocks * block_size + 1, (n,), generator=g)
    lens[0], lens[1] = max_blocks * block_size, 17
    q = (3 * torch.randn(n, num_heads, head_dim, generator=g)).bfloat16()
    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, window)
    ref = reference_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, window)
    assert (out.float() - ref.float()).abs().max() <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("n", [2, 8])  # one KV head per task, and all of them
def test_keys_outside_the_attended_positions_never_reach_the_output(n):
    """Tile products read a block's 16 rows at once: NaN keys and values in rows past the context (a block's unused
    slots) and before a sliding window's first position must not reach the output, which equals the same call's on
    a cache holding zeros there."""
    block_size, max_blocks = 16, 3
    g = torch.Generator().manual_seed(n)
    k_cache, v_cache = (torch.randn(n * max_blocks, block_size, 3, 64, generator=g).bfloat16() for _ in range(2))
    tables = torch.arange(n * max_blocks).view(n, max_blocks)
    lens, window = torch.full((n,), 37), 29  # attended: positions 8 .. 36 (an odd count: the weighted sum pairs
    # the last one with the padding's score)
    q = torch.randn(n, 9, 64, generator=g).bfloat16()
    clean_k, clean_v = k_cache.clone(), v_cache.clone()
    for i in range(n):
        for cache, clean in ((k_cache, clean_k), (v_cache, clean_v)):
            cache[tables[i, 0], :8] = float("nan")  # before the window
            cache[tables[i, 2], 5:] = float("nan")  # past the context
            clean[tables[i, 0], :8] = 0
            clean[tables[i, 2], 5:] = 0
    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, window)
    assert torch.isfinite(out).all()
    assert torch.equal(out, cpu_decode.paged_decode(q, clean_k, clean_v, tables, lens, 0.125, window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 13])
def test_every_thread_count_gives_the_same_bits(dtype, n):
    """Which thread runs a request, and whether a task is a whole request or one of its KV heads (few requests per
    thread), depends on the thread count: each request's output must not (1, 2 and 3 threads, contexts of unequal
    length, the same bits)."""
    g = torch.Generator().manual_seed(5)
    block_size, max_blocks = 16, 6
    k_cache, v_cache = (torch.randn(100, block_size, 3, 64, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(100, generator=g)[: n * max_blocks].view(n, max_blocks)
    lens = torch.randint(1, max_blocks * block_size + 1, (n,), generator=g)
    q = torch.randn(n, 9, 64, generator=g).to(dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_extreme_scores_stay_finite():
    """Scores far apart (one key dominates; the rest underflow exp) give that key's value, not NaN."""
    k_cache = torch.zeros(4, 4, 1, 16)
    v_cache = torch.arange(4 * 4 * 16, dtype=torch.float32).view(4, 4, 1, 16)
    k_cache[2, 1, 0] = 100.0
    q = torch.ones(1, 1, 16)
    out = cpu_decode.paged_decode(q, k_cache, v_cache, torch.tensor([[2, 0]]), torch.tensor([8]), 1.0)
    assert torch.equal(out[0, 0], v_cache[2, 1, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: its own path where AVX512-BF16 is
@pytest.mark.parametrize("context", [7, 64])  # a context shorter than one vector of lanes, and whole vectors
def test_a_nan_score_makes_the_output_nan_as_in_torch(context, dtype):
    """A NaN key (a numerical fault upstream) must show, not be dropped by the softmax: the request's output is NaN,
    as torch's softmax gives; the other request is untouched."""
    k_cache, v_cache = torch.randn(8, 16, 1, 64).to(dtype), torch.randn(8, 16, 1, 64).to(dtype)
    k_cache[0, 3, 0, 5] = float("nan")
    tables, lens = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), torch.tensor([context, context])
    q = torch.randn(2, 2, 64).to(dtype)
    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    ref = reference_decode(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.isnan(out[0]).all() and torch.isnan(ref[0]).all()
    assert (out[1].float() - ref[1].float()).abs().max() <= TOLERANCE[dtype]


def test_bad_input_is_refused():
    q = torch.randn(2, 4, 16)
    cache = torch.randn(10, 4, 2, 16)
    tables = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(RuntimeError, match="seq_len out of its table"):
        cpu_decode.paged_decode(q, cache, cache, tables, torch.tensor([13, 1]), 1.0)
    with pytest.raises(RuntimeError, match="block id 10 outside the cache"):
        cpu_decode.paged_decode(q, cache, cache, torch.tensor([[0, 10, 0], [0, 0, 0]]), torch.tensor([5, 1]), 1.0)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        cpu_decode.paged_decode(q.double(), cache, cache, tables, torch.tensor([1, 1]), 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_decode.paged_decode(q, torch.randn(10, 4, 2, 32)[..., :16], cache, tables, torch.tensor([1, 1]), 1.0)
    with pytest.raises(RuntimeError, match="of one shape"):
        cpu_decode.paged_decode(q, cache, cache[:5], tables, torch.tensor([1, 1]), 1.0)


def test_backend_is_refused_with_the_reason_when_the_kernel_cannot_be_built(monkeypatch):
    from minibatch.runner.backends import get_backend

    monkeypatch.setattr(cpu_decode.KERNEL, "module", None)
    monkeypatch.setattr(cpu_decode.KERNEL, "error", "OSError: no C++ compiler")
    with pytest.raises(ValueError, match="attention_backend 'cpp' is not available here: .*no C\\+\\+ compiler"):
        get_backend("cpp").check("cpu", torch.float32)
    with pytest.raises(ValueError, match="runs on cpu, not cuda"):
        get_backend("cpp").check("cuda", torch.float32)
