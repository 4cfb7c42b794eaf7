"""The AVX512-BF16 linear (kernels/cpu_bf16_linear.cpp) on oneDNN's prepacked weight: every output is its row's input
pairs summed in order as VDPBF16PS does (checked bit for bit against a float32 emulation), within one bf16 rounding
of oneDNN's, batch-invariant; the layout check refuses what it cannot read; the engine runs it only inside its own
steps. Skipped on CPUs without AVX512-BF16 or where oneDNN lays bf16 weights out for AMX (the callers keep oneDNN or
the AMX kernel there, which test_prepack, test_amx_linear and test_fused_layers cover)."""

import pytest
import torch

from minibatch.kernels import cpu_bf16_linear
from minibatch.runner.prepack import can_prepack


def prepacked(n, k, seed=0, hint=32):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    return w, torch.ops.mkldnn._reorder_linear_weight(w, hint)


def runs_here() -> bool:
    if not (cpu_bf16_linear.cpu_has_avx512_bf16() and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported() and cpu_bf16_linear.KERNEL.available()):
        return False
    w, packed = prepacked(64, 64)
    return cpu_bf16_linear.layout_ok(packed, w)


HERE = runs_here()
needs_kernel = pytest.mark.skipif(not HERE, reason="no AVX512-BF16 layout here (no such CPU, AMX's layout, or no "
                                                   "compiler)")


def in_order(x, w, bias):
    """x (m, k) w^T (+ bias) as the kernel sums it, emulated in float32: per output, for each pair of input
    features in order, the odd product added then the even one (VDPBF16PS; bf16 products are exact in float32), each
    sum rounded to float32; then the bias; then bf16 by round-to-nearest-even."""
    xs, ws = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for j in range(0, x.shape[1], 2):
        for i in (j + 1, j):
            if i < x.shape[1]:
                acc = acc + xs[:, i:i + 1] * ws[:, i][None]
    return (acc + (bias.float() if bias is not None else 0)).to(torch.bfloat16)


def test_without_the_instructions_the_layout_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_bf16_linear, "cpu_has_avx512_bf16", lambda: False)
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert not cpu_bf16_linear.layout_ok(w, w)  # and nothing is built for it


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 600), (40, 64), (7, 3)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 32, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_sums_run_in_order_and_stay_within_a_rounding_of_onednn(n, k, rows, with_bias):
    w, packed = prepacked(n, k)
    assert cpu_bf16_linear.layout_ok(packed, w)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    ours = cpu_bf16_linear.bf16_linear(x, packed, n, bias)
    assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), in_order(x, w, bias).view(torch.int16))
    theirs = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    # one bf16 rounding of the larger (8 bits of mantissa), plus float32 sums in another order: k roundings of at most
    # 2^-24 of the terms' magnitudes (where the sum cancels to near zero, that is most of the difference)
    bound = torch.maximum(ours.float().abs(), theirs.float().abs()) * 2.0 ** -7 \
        + k * 2.0 ** -24 * (x.float().abs() @ w.float().abs().T)
    assert bool(((ours.float() - theirs.float()).abs() <= bound).all())


@needs_kernel
def test_every_row_is_what_it_would_be_alone():
    w, packed = prepacked(576, 1536)
    x = torch.randn(64, 1536, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = cpu_bf16_linear.bf16_linear(x, packed, 576, None)
    for i in (0, 5, 6, 31, 63):
        assert torch.equal(out[i], cpu_bf16_linear.bf16_linear(x[i:i + 1], packed, 576, None)[0])
    assert cpu_bf16_linear.bf16_linear(x[:0], packed, 576, None).shape == (0, 576)


@needs_kernel
@pytest.mark.parametrize("n", [576, 100])
def test_any_thread_count_gives_the_same_numbers(n):
    """The threads split the blocks' 16-feature vectors (576 features: 9 blocks, one of them shared on 2 threads):
    the same bits on 1, 2 or 3 threads."""
    w, packed = prepacked(n, 1536)
    x = torch.randn(13, 1536, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(cpu_bf16_linear.bf16_linear(x, packed, n, None))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert torch.equal(outs[0].view(torch.int16), in_order(x, w, None).view(torch.int16))


@needs_kernel
def test_layout_check_refuses_what_the_kernel_cannot_read():
    w, packed = prepacked(3072, 576)
    other = w.clone()
    other[5, 7] += 1
    assert not cpu_bf16_linear.layout_ok(packed, other)  # another weight's bytes
    assert not cpu_bf16_linear.layout_ok(packed, w[:, :544])  # another shape
    assert not cpu_bf16_linear.layout_ok(w, w)  # a plain tensor


@needs_kernel
def test_bad_input_is_a_clear_error():
    w, packed = prepacked(64, 64)
    with pytest.raises(RuntimeError, match="bf16_linear: x must be"):
        cpu_bf16_linear.bf16_linear(torch.zeros(2, 64), packed, 64, None)
    with pytest.raises(RuntimeError, match="bf16_linear: packed is not"):
        cpu_bf16_linear.bf16_linear(torch.zeros(2, 96, dtype=torch.bfloat16), packed, 64, None)
    w, packed = prepacked(100, 570)  # 570 input features are padded to 576, as 576 are: still refused
    with pytest.raises(RuntimeError, match="bf16_linear: packed is not"):
        cpu_bf16_linear.bf16_linear(torch.zeros(2, 576, dtype=torch.bfloat16), packed, 100, None)
    w, packed = prepacked(64, 64)
    with pytest.raises(RuntimeError, match="bf16_linear: bias must be"):
        cpu_bf16_linear.bf16_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, 64, torch.zeros(3))


@needs_kernel
def test_the_modules_run_it_inside_the_engine_only(monkeypatch):
    """A prepacked bf16 model: its linears give F.linear's outputs bit for bit outside ``engine_linears`` (the
    Hugging Face reference, the baselines), run this kernel inside it for up to BF16_MAX_ROWS rows, and oneDNN
    above that."""
    from minibatch.models import load_model
    from minibatch.runner import prepack

    model, _ = load_model("tiny-random-llama", dtype="bfloat16")
    if not can_prepack(model):
        pytest.skip("no oneDNN bf16 on this CPU")
    prepack.prepack_linears(model)
    head = model.lm_head
    assert head.bf16 and all(m.group.bf16 for m in model.modules() if isinstance(m, prepack.GroupedLinear))
    calls = []
    real = cpu_bf16_linear.bf16_linear
    monkeypatch.setattr(cpu_bf16_linear, "bf16_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    x = torch.randn(3, head.in_features).to(torch.bfloat16)
    big = torch.randn(cpu_bf16_linear.BF16_MAX_ROWS + 1, head.in_features).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight)) and not calls
        with prepack.engine_linears():
            assert torch.equal(head(x), real(x, head.packed_weight, head.out_features, None)) and calls == [3]
            assert torch.equal(head(big), torch.nn.functional.linear(big, head.weight)) and calls == [3]
