"""Prepacked linear weights (minibatch/runner/prepack.py): on a CPU in bf16 every Linear runs oneDNN with its
weight laid out once, and the outputs are bit-identical to F.linear's, whatever the number of rows; in float32 the
engine's steps run our packed kernel (kernels/cpu_linear.cpp), checked against a float64 product."""

import pytest
import torch

from minibatch.kernels.cpp_build import compiler_available
from minibatch.models import load_model
from minibatch.runner import ModelRunner
from minibatch.runner.prepack import PrepackedLinear, can_prepack, prepack_linears

NO_COMPILER = "no C++ compiler to build the float32 linear kernel"


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_prepacked_model_gives_the_same_logits_bit_for_bit(rows, one_thread):
    model, _ = load_model("tiny-random-llama", dtype="bfloat16")
    if not can_prepack(model):
        pytest.skip("no oneDNN bf16 on this CPU")
    ids = torch.randint(3, model.config.vocab_size, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        before = model(ids).logits
        assert prepack_linears(model) > 0 and prepack_linears(model) == 0  # idempotent
        after = model(ids).logits
    assert torch.equal(before, after)
    assert all(type(m) is not torch.nn.Linear for m in model.modules())


def test_only_cpu_bf16_models_are_prepacked_and_the_runner_can_opt_out():
    fp32, tok = load_model("tiny-random-llama", dtype="float32")
    assert prepack_linears(fp32) == 0 and not any(isinstance(m, PrepackedLinear) for m in fp32.modules())
    bf16, _ = load_model("tiny-random-llama", dtype="bfloat16")
    ModelRunner(bf16, tok, prepack_weights=False)
    assert not any(isinstance(m, PrepackedLinear) for m in bf16.modules())


def test_sibling_projections_run_as_one_product_and_a_lone_call_runs_alone():
    """q/k/v_proj and gate/up_proj share one prepacked product; a member called on another input (or before its
    group's first member) computes its own output; prepacking again after a weight edit refreshes the group."""
    from minibatch.runner.prepack import GroupedLinear

    model, _ = load_model("tiny-random-llama", dtype="bfloat16")
    if not can_prepack(model):
        pytest.skip("no oneDNN bf16 on this CPU")
    prepack_linears(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(isinstance(m, GroupedLinear) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj,
                                                      mlp.up_proj))
    assert attn.q_proj.group is attn.v_proj.group and type(attn.o_proj) is PrepackedLinear
    x, other = torch.randn(2, 5, attn.q_proj.in_features).bfloat16(), torch.randn(5, attn.q_proj.in_features).bfloat16()
    with torch.inference_mode():
        alone = [torch.nn.functional.linear(x, m.weight) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        assert torch.equal(attn.k_proj(x), alone[1])  # before the first member: computed alone
        q = attn.q_proj(x)
        assert torch.equal(attn.k_proj(other), torch.nn.functional.linear(other, attn.k_proj.weight))
        assert [torch.equal(a, b) for a, b in zip((q, attn.k_proj(x), attn.v_proj(x)), alone)] == [True] * 3
        assert attn.q_proj.group.kept is None  # every column taken
        attn.k_proj.weight.mul_(2)
        prepack_linears(model)
        attn.q_proj(x)
        assert torch.equal(attn.k_proj(x), torch.nn.functional.linear(x, attn.k_proj.weight))


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_float32_siblings_fused_give_the_same_logits_bit_for_bit(rows, one_thread):
    """The float32 groupings change no logit: ``fuse_siblings(layout="plain")`` (one F.linear per group; what
    benchmarks/fused_projections.py --dtype float32 times) and, inside the engine's steps, groups on our packed
    kernel's panels (the kernel computes each output feature alone) against the same panels one layer at a time;
    outside the engine the packed model is stock F.linear."""
    from minibatch.runner.prepack import GroupedLinear, engine_linears, fuse_siblings, pack_linears

    model, tok = load_model("tiny-random-llama", dtype="float32")
    ids = torch.randint(3, model.config.vocab_size, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        before = model(ids).logits
        assert fuse_siblings(model, layout="plain") == 2 * model.config.num_hidden_layers
        assert torch.equal(before, model(ids).logits) and model.model.layers[0].mlp.up_proj.group.layout == "plain"
        if not compiler_available():
            pytest.skip(NO_COMPILER)
        assert pack_linears(model, fuse=False) > 0 and not any(isinstance(m, GroupedLinear) for m in model.modules())
        with engine_linears():
            alone = model(ids).logits
            assert fuse_siblings(model, layout="panels") == 2 * model.config.num_hidden_layers
            assert torch.equal(alone, model(ids).logits)
        assert torch.equal(before, model(ids).logits)


def test_packed_linear_matches_a_float64_product_for_any_shape_and_is_batch_invariant():
    """The float32 kernel against F.linear in float64 (relative error < 1e-5), for widths that are and are not
    multiples of the 16-feature panel, row counts around the 6-row micro-kernel, with and without bias; each row's
    output is bit-identical whatever the other rows of its batch and the thread count. Also: no rows, no input
    features (each output its bias), 3-d and non-contiguous inputs, and the contract's errors."""
    from minibatch.kernels import cpu_linear

    if not compiler_available():
        pytest.skip(NO_COMPILER)
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for n, k in ((1, 3), (17, 5), (100, 37), (576, 64)):
            w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            panels = cpu_linear.pack_weight(w)
            unpacked = panels.permute(0, 2, 1).reshape(-1, k)  # feature j of panel p: row 16 p + j
            assert panels.shape == (-(-n // 16), k, 16) and torch.equal(unpacked[:n], w) and not unpacked[n:].any()
            for rows in (1, 2, 5, 6, 7, 13, 64):
                x = torch.randn(rows, k, generator=g)
                for bias in (None, b):
                    torch.set_num_threads(2)
                    out = cpu_linear.packed_linear(x, panels, n, bias)
                    ref = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
                    assert out.shape == (rows, n) and out.dtype == torch.float32
                    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
                    torch.set_num_threads(1)
                    assert torch.equal(cpu_linear.packed_linear(x[-1:], panels, n, bias), out[-1:])
    finally:
        torch.set_num_threads(threads)
    w, b = torch.randn(20, 8, generator=g), torch.randn(20, generator=g)
    panels = cpu_linear.pack_weight(w)
    assert cpu_linear.packed_linear(torch.randn(0, 8), panels, 20, b).shape == (0, 20)
    assert torch.equal(cpu_linear.packed_linear(torch.randn(3, 0), cpu_linear.pack_weight(torch.randn(20, 0)), 20, b),
                       b.expand(3, 20))
    x = torch.randn(2, 8, 5, generator=g).transpose(1, 2)  # (2, 5, 8), not contiguous
    out = cpu_linear.packed_linear(x, panels, 20, b)
    assert out.shape == (2, 5, 20) and torch.allclose(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="packed must be"):
        cpu_linear.packed_linear(torch.randn(2, 5), cpu_linear.pack_weight(torch.randn(4, 6)), 4)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_linear.packed_linear(torch.randn(2, 8), panels, 20, torch.randn(19))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.pack_weight(torch.randn(4, 6, dtype=torch.float64))


def test_packed_linear_portable_lanes_give_the_same_numbers_as_the_vector_ones():
    """The kernel's plain C++ lanes (what CPUs without AVX2 + FMA build, e.g. ARM laptops; forced here with
    -DMINIBATCH_PORTABLE) and its vector lanes (AVX2: 6-row blocks of two 8-lane registers; AVX-512: 12-row blocks
    of one 16-lane register) sum the same products in the same order with one rounding per fused multiply-add:
    bit-identical outputs, for row counts on both sides of either block size."""
    from minibatch.kernels import cpu_linear
    from minibatch.kernels.cpp_build import build

    if not compiler_available():
        pytest.skip(NO_COMPILER)
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 here: both builds would run the plain lanes")
    portable = build(cpu_linear.SOURCE, ("-DMINIBATCH_PORTABLE",))
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 70, generator=g), torch.randn(40, generator=g)
    panels = cpu_linear.pack_weight(w)
    assert torch.equal(portable.pack_weight(w), panels)
    for rows in (1, 6, 11, 12, 13, 25):
        x = torch.randn(rows, 70, generator=g)
        for bias in (None, b):
            ours = cpu_linear.packed_linear(x, panels, 40, bias)
            assert torch.equal(portable.packed_linear(x, panels, 40, bias), ours)


def test_panel_linears_run_the_kernel_in_the_engine_only_and_f_linear_elsewhere(monkeypatch):
    """PanelLinear: stock F.linear outside ``engine_linears`` (bit for bit) and for more than PANEL_MAX_ROWS rows;
    the kernel inside it, and in the runner's own steps; a weight edited in place runs F.linear until packed again;
    a packing refused (memory) leaves plain nn.Linear layers, never stale panels."""
    from minibatch.experiment import decoding_engine
    from minibatch.kernels import cpu_linear
    from minibatch.runner import prepack

    if not compiler_available():
        pytest.skip(NO_COMPILER)
    model, tok = load_model("tiny-random-llama", dtype="float32")
    ModelRunner(model, tok, prepack_weights=False)
    assert not any(isinstance(m, prepack.PanelLinear) for m in model.modules())
    runner = ModelRunner(model, tok)
    head = model.lm_head
    assert isinstance(head, prepack.PanelLinear)
    assert isinstance(model.model.layers[0].mlp.down_proj, prepack.PanelLinear)
    calls = []
    real = cpu_linear.packed_linear
    rows = lambda x: x.numel() // x.shape[-1]  # noqa: E731
    monkeypatch.setattr(cpu_linear, "packed_linear", lambda *a: calls.append(rows(a[0])) or real(*a))
    engine = decoding_engine(runner, [8, 8], 4)
    for _ in range(3):  # up to the two prompts' prefill: 16 rows (the LM head on their last two)
        if 16 in calls:
            break
        engine.step()
    assert 16 in calls
    calls.clear()
    engine.step()  # a decode step of the two requests: every linear on the kernel
    assert set(calls) == {2}
    calls.clear()
    x = torch.randn(2, 3, head.in_features)
    with torch.inference_mode():
        stock = torch.nn.functional.linear(x, head.weight)
        assert torch.equal(head(x), stock) and not calls  # outside the engine: F.linear, bit for bit
        with prepack.engine_linears():
            fast = head(x)
            assert calls == [6] and fast.shape == stock.shape and torch.allclose(fast, stock, rtol=1e-5, atol=1e-5)
            big = torch.randn(prepack.PANEL_MAX_ROWS + 1, head.in_features)
            assert torch.equal(head(big), torch.nn.functional.linear(big, head.weight)) and calls == [6]
        head.weight.mul_(2)  # edited in place: the panels are stale, so F.linear until packed again
        with prepack.engine_linears():
            assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight)) and calls == [6]
        assert prepack.pack_linears(model) > 0
        with prepack.engine_linears():
            assert torch.allclose(head(x), 2 * stock, rtol=1e-5, atol=1e-5) and calls == [6, 6]
        monkeypatch.setattr(prepack, "can_pack_panels", lambda model: False)
        assert prepack.pack_linears(model) == 0 and type(head) is torch.nn.Linear and not hasattr(head, "panels")
