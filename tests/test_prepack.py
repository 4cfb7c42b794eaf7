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
