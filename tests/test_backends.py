"""The attention-backend registry (minibatch/runner/backends): the torch reference and the Triton kernels are two
entries; a backend registered from outside the package (here, and from a --policy-module file) runs under its
name in compare and serve, token for token like HF generate; unsupported settings and unknown names are refused."""

import json

import pytest
import torch

from minibatch.__main__ import main
from minibatch.clock import SimClock
from minibatch.models import load_model
from minibatch.policies import make_engine
from minibatch.request import Request
from minibatch.runner import ModelRunner
from minibatch.runner.backends import BACKENDS, AttentionBackend, backend_names, get_backend, register_backend
from minibatch.runner.backends.torch_ref import TorchBackend

PLUGIN = '''
from minibatch.runner.backends import register_backend
from minibatch.runner.backends.torch_ref import TorchBackend


class Counting(TorchBackend):
    """The torch reference, counting its calls."""
    name = "counting_plugin"
    description = "torch reference that counts its forward calls"
    calls = 0

    def forward(self, m, layer, q, k, v, scale, window):
        type(self).calls += 1
        return super().forward(m, layer, q, k, v, scale, window)


register_backend(Counting())
'''


class Counting(TorchBackend):
    name = "counting"
    calls = 0

    def forward(self, m, layer, q, k, v, scale, window):
        type(self).calls += 1
        return super().forward(m, layer, q, k, v, scale, window)


def greedy_reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate's greedy tokens after ``prompt``."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(autouse=True)
def registry():
    """Each test starts from, and leaves, the built-in backends."""
    saved = dict(BACKENDS)
    yield
    BACKENDS.clear()
    BACKENDS.update(saved)


def test_the_built_ins_are_two_entries():
    assert backend_names()[:2] == ("torch", "triton")
    assert get_backend("torch") is BACKENDS["torch"] and get_backend(BACKENDS["triton"]) is BACKENDS["triton"]
    with pytest.raises(ValueError, match="attention_backend must be one of torch, triton.*'flash'"):
        get_backend("flash")


def test_a_backend_registered_outside_the_package_runs_like_generate(one_thread):
    register_backend(Counting())
    model, tok = load_model("tiny-random-llama", dtype="float32")
    prompt = list(range(5, 25))
    ref = greedy_reference(model, prompt, 8)
    req = Request("a", prompt, max_new_tokens=8)
    make_engine("paged", ModelRunner(model, tok, attention_backend="counting"), SimClock(), n_slots=256).generate([req])
    assert req.output_token_ids == ref
    assert Counting.calls >= 8 * model.config.num_hidden_layers  # every layer of every step went through it


def test_a_backend_refuses_what_it_does_not_support():
    class Fp32Only(TorchBackend):
        name, dtypes = "fp32_only", (torch.float32,)

    register_backend(Fp32Only())
    model, tok = load_model("tiny-random-llama", dtype="bfloat16")
    with pytest.raises(ValueError, match="'fp32_only' supports dtypes float32, not torch.bfloat16"):
        ModelRunner(model, tok, attention_backend="fp32_only")
    class Blocks16(TorchBackend):
        name, block_sizes = "blocks16", (16,)

    register_backend(Blocks16())
    runner = ModelRunner(load_model("tiny-random-llama", dtype="float32")[0], attention_backend="blocks16")
    runner.allocate_kv_cache(4, 16)
    with pytest.raises(ValueError, match="'blocks16' supports block_size in \\(16,\\), not 4"):
        runner.allocate_kv_cache(16, 4)
    with pytest.raises(ValueError, match="registered already"):
        register_backend(type("Other", (AttentionBackend,), {"name": "torch"})())


def test_compare_takes_a_plugin_backend_from_a_policy_module(tmp_path, one_thread):
    plugin = tmp_path / "counting.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "out.json"
    main(["compare", "--dtype", "float32", "--model", "tiny-random-llama", "--policy-module", str(plugin),
          "--attention-backend", "counting_plugin", "--policies", "paged,chunked", "--num-requests", "6",
          "--rate", "20", "--max-output-len", "16", "--clock", "sim", "--figures-dir", "", "--no-progress",
          "--json", str(out)])
    result = json.loads(out.read_text())
    assert {p: r["matches_reference"] for p, r in result["policies"].items()} == {"paged": True, "chunked": True}
    assert get_backend("counting_plugin").calls > 0


def test_an_unknown_backend_is_one_line_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--model", "tiny-random-llama", "--attention-backend", "flash", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--attention-backend" in err and "torch" in err and "flash" in err


def test_serve_runs_a_registered_backend(one_thread):
    import openai

    from minibatch.serving.background import ServerThread
    from minibatch.serving.launch import build_server

    register_backend(Counting())
    model, tok = load_model("tiny-random-llama", dtype="float32")
    prompt = list(range(5, 17))
    ref = greedy_reference(model, prompt, 6)
    calls = Counting.calls
    app, engine = build_server("tiny-random-llama", "paged", dict(n_slots=256), loaded=(model, tok),
                               attention_backend="counting")
    with ServerThread(app, engine) as srv:
        out = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0).completions.create(
            model="tiny-random-llama", prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True})
    assert out.choices[0].text == tok.decode(ref, skip_special_tokens=True) and Counting.calls > calls


def test_compiled_decode_splits_by_context_length_and_agrees_with_sdpa(one_thread):
    """Decodes of very different context lengths run as a short and a long group (each padded only to its own
    longest context); the result equals one padded SDPA call."""
    from minibatch.runner.backends.compiled import CompiledBackend, length_groups
    from minibatch.runner.backends.sdpa import SdpaAttentionData, decode_attention

    g = torch.Generator().manual_seed(0)
    block_size, n, num_blocks = 4, 20, 401
    k_cache, v_cache = (torch.randn(num_blocks, block_size, 2, 8, generator=g) for _ in range(2))
    lens = torch.tensor([3 + 2 * i if i % 2 else 60 + i for i in range(n)])  # short and long, interleaved
    tables = torch.randperm(num_blocks - 1, generator=g)[: n * 20].view(n, 20) + 1
    q = torch.randn(n, 4, 8, generator=g)
    groups = length_groups(lens, tables, block_size)
    assert len(groups) == 2 and sorted(torch.cat([r for r, _, _ in groups]).tolist()) == list(range(n))
    assert groups[0][1].shape[1] < tables.shape[1]  # the short group reads fewer blocks
    mask = (torch.arange(20 * block_size)[None, :] < lens[:, None])[:, None, None, :]
    data = SdpaAttentionData(True, decode_tables=tables, decode_mask=mask, decode_lens=lens, decode_groups=groups)
    expected = decode_attention(q, k_cache, v_cache, data, 0.35)
    assert torch.allclose(CompiledBackend().decode(q, k_cache, v_cache, data, 0.35, None), expected, atol=1e-5)
