"""Prepacked linear weights (minibatch/runner/prepack.py): on a CPU in bf16 every Linear runs oneDNN with its
weight laid out once, and the outputs are bit-identical to F.linear's, whatever the number of rows."""

import pytest
import torch

from minibatch.models import load_model
from minibatch.runner import ModelRunner
from minibatch.runner.prepack import PrepackedLinear, can_prepack, prepack_linears


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
    """The float32 grouping (``fuse_siblings(prepacked=False)``, one F.linear per group; what
    benchmarks/fused_projections.py --dtype float32 times) changes no logit; the runner leaves float32 layers be."""
    from minibatch.runner.prepack import GroupedLinear, fuse_siblings

    model, tok = load_model("tiny-random-llama", dtype="float32")
    ids = torch.randint(3, model.config.vocab_size, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        before = model(ids).logits
        assert fuse_siblings(model, prepacked=False) == 2 * model.config.num_hidden_layers
        after = model(ids).logits
    assert torch.equal(before, after)
    assert not model.model.layers[0].mlp.up_proj.group.prepacked
    fresh, _ = load_model("tiny-random-llama", dtype="float32")
    ModelRunner(fresh, tok)
    assert not any(isinstance(m, GroupedLinear) for m in fresh.modules())


def test_split_linear_answers_like_f_linear_and_keeps_out_of_keys_where_it_differs(monkeypatch):
    """float32 on a CPU with 2 threads: every call of a SplitLinear equals F.linear bit for bit, whatever the rows;
    a key whose split once differed runs F.linear from then on; prefills and one thread run F.linear."""
    from minibatch.kernels import cpu_split_linear
    from minibatch.runner import prepack

    if not cpu_split_linear.available():
        pytest.skip("no C++ compiler to build the split linear kernel")
    monkeypatch.setattr(prepack, "_split_exact", {})
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layer = torch.nn.Linear(96, 640, bias=True)
        layer.__class__ = prepack.SplitLinear
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for rows in (1, 2, 5, 7, 32, 64, 65, 300):
                x = torch.randn(1, rows, 96, generator=g)
                for _ in range(2):  # the first call of a key checks, the second uses the verdict
                    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
            assert {k[3] for k in prepack._split_exact} == {1, 2, 5, 7, 32, 64}  # prefills never split
            calls = []
            real = cpu_split_linear.split_linear
            monkeypatch.setattr(cpu_split_linear, "split_linear", lambda *a: calls.append(1) or real(*a) + 1)
            x = torch.randn(3, 96, generator=g)
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))  # differed
            assert prepack._split_exact[(640, 96, True, 3, 2)] is False and len(calls) == 1
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)) and len(calls) == 1
            torch.set_num_threads(1)
            assert torch.equal(layer(x[:1]), torch.nn.functional.linear(x[:1], layer.weight, layer.bias))
    finally:
        torch.set_num_threads(threads)


def test_the_runner_splits_float32_linears_unless_told_not_to():
    from minibatch.kernels import cpu_split_linear
    from minibatch.runner.prepack import SplitLinear

    if not cpu_split_linear.available():
        pytest.skip("no C++ compiler to build the split linear kernel")
    model, tok = load_model("tiny-random-llama", dtype="float32")
    ModelRunner(model, tok, prepack_weights=False)
    assert not any(isinstance(m, SplitLinear) for m in model.modules())
    ModelRunner(model, tok)
    assert isinstance(model.lm_head, SplitLinear) and isinstance(model.model.layers[0].mlp.down_proj, SplitLinear)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_split_linear.split_linear(torch.randn(2, 3), torch.randn(4, 5), None)
