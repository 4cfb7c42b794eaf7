"""The AMX bf16 linear (kernels/cpu_amx_linear.cpp) against oneDNN's matmul on the same prepacked weight: bit for
bit up to AMX_MAX_ROWS rows, batch-invariant, the layout check refusing what the kernel cannot read. Skipped on CPUs
without AMX (the callers keep oneDNN there, which test_prepack and test_fused_layers cover)."""

import pytest
import torch

from minibatch.kernels import cpu_amx_linear
from minibatch.runner.prepack import can_prepack

HAS_AMX = cpu_amx_linear.cpu_has_amx() and cpu_amx_linear.KERNEL.available()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX (or the kernel does not build here)")


def prepacked(n, k, seed=0, hint=32):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    return w, torch.ops.mkldnn._reorder_linear_weight(w, hint)


def onednn(x, packed, bias):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def test_without_amx_the_layout_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_amx_linear, "cpu_has_amx", lambda: False)
    w = torch.zeros(32, 32, dtype=torch.bfloat16)
    assert not cpu_amx_linear.layout_ok(w, w)  # and nothing is built for it


@needs_amx
@pytest.mark.parametrize("n,k", [(960, 576), (576, 576), (3072, 576), (576, 1536), (100, 576), (40, 64), (50, 100)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bit_for_bit_onednn_up_to_32_rows(n, k, rows, with_bias):
    w, packed = prepacked(n, k)
    assert cpu_amx_linear.layout_ok(packed, w)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    ours = cpu_amx_linear.amx_linear(x, packed, n, bias)
    assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
    assert torch.equal(ours, onednn(x, packed, bias))
    exact = x.float() @ w.float().T + (bias.float() if with_bias else 0)
    torch.testing.assert_close(ours.float(), exact, rtol=1e-2, atol=1e-2)


@needs_amx
@pytest.mark.parametrize("rows", [33, 64, 100])
def test_more_rows_and_batch_invariance(rows):
    """Any row count works; every row is what it would be alone (oneDNN changes its blocking above 32 rows, ours
    does not)."""
    w, packed = prepacked(576, 1536)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = cpu_amx_linear.amx_linear(x, packed, 576, None)
    for i in (0, 16, 31, rows - 1):
        assert torch.equal(out[i], cpu_amx_linear.amx_linear(x[i:i + 1], packed, 576, None)[0])
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-2)


@needs_amx
def test_layout_check_refuses_what_the_kernel_cannot_read():
    w, packed = prepacked(3072, 576)
    other = w.clone()
    other[5, 7] += 1
    assert not cpu_amx_linear.layout_ok(packed, other)  # another weight's bytes
    assert not cpu_amx_linear.layout_ok(packed, w[:, :544])  # another shape
    _, packed_for_one_row = prepacked(3072, 576, hint=1)  # oneDNN's 64-wide blocks for a batch hint of 1
    assert not cpu_amx_linear.layout_ok(packed_for_one_row, w)
    assert not cpu_amx_linear.layout_ok(w, w)  # a plain tensor


@needs_amx
def test_bad_input_is_a_clear_error():
    w, packed = prepacked(64, 64)
    with pytest.raises(RuntimeError, match="amx_linear: x must be"):
        cpu_amx_linear.amx_linear(torch.zeros(2, 64), packed, 64, None)
    with pytest.raises(RuntimeError, match="amx_linear: packed is not"):
        cpu_amx_linear.amx_linear(torch.zeros(2, 96, dtype=torch.bfloat16), packed, 64, None)
    w, packed = prepacked(100, 570)  # 570 input features are padded to 576, as 576 are: still refused
    with pytest.raises(RuntimeError, match="amx_linear: packed is not"):
        cpu_amx_linear.amx_linear(torch.zeros(2, 576, dtype=torch.bfloat16), packed, 100, None)
    w, packed = prepacked(64, 64)
    with pytest.raises(RuntimeError, match="amx_linear: bias must be"):
        cpu_amx_linear.amx_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, 64, torch.zeros(3))
    assert cpu_amx_linear.amx_linear(torch.zeros(0, 64, dtype=torch.bfloat16), packed, 64, None).shape == (0, 64)


@needs_amx
def test_prepacked_layers_use_it_for_decode_rows_only():
    """A prepacked model's linears run AMX up to AMX_MAX_ROWS rows and oneDNN above, with the same outputs as oneDNN
    where it is bit for bit (up to 32 rows)."""
    from minibatch.runner.prepack import PrepackedLinear, prepack_linears

    lin = torch.nn.Linear(576, 960, dtype=torch.bfloat16)
    model = torch.nn.Sequential(lin)
    assert can_prepack(model) and prepack_linears(model) == 1 and type(lin) is PrepackedLinear and lin.amx
    calls = []
    real = cpu_amx_linear.amx_linear
    try:
        cpu_amx_linear.amx_linear = lambda *a: calls.append(a[0].shape[0]) or real(*a)
        for rows in (1, 32, 33):
            x = torch.randn(rows, 576).to(torch.bfloat16)
            assert torch.equal(lin(x), onednn(x, lin.packed_weight, lin.bias)) or rows > 32
    finally:
        cpu_amx_linear.amx_linear = real
    assert calls == [1, 32]
