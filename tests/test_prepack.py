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
