"""models.py and gguf.py: offline loading of the tiny random models and of SmolLM2-135M (GGUF -> cache).

The SmolLM2 tests use the real cache (``$MINIBATCH_CACHE`` or ``~/.cache/minibatch``) so the
~20 s GGUF conversion happens at most once per machine; the tiny-model tests take milliseconds.
"""


import pytest
import torch
from transformers import PreTrainedTokenizerFast

from minibatch import gguf
from minibatch.gguf import load_smollm2_from_gguf, smollm2_cache_path
from minibatch.models import MODEL_NAMES, load_model, tiny_tokenizer

TINY = ("tiny-random-llama", "tiny-random-gpt2")


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_loads_frozen_and_deterministic(name):
    model, tokenizer = load_model(name)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.config.vocab_size == 512 and len(tokenizer) == 512
    assert (model.config.eos_token_id, model.config.bos_token_id, model.config.pad_token_id) == (2, 1, 0)
    assert model.generation_config.pad_token_id is not None
    again, _ = load_model(name)
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    logits = model(torch.tensor([tokenizer.encode("hello")])).logits
    assert logits.shape == (1, 5, 512)


def test_tiny_load_does_not_disturb_caller_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_model("tiny-random-llama")
    assert torch.equal(torch.rand(3), expected)


def test_tiny_llama_is_gqa():
    config = load_model("tiny-random-llama")[0].config
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.tie_word_embeddings is False


@pytest.mark.parametrize("name", TINY)
def test_tiny_dtype_and_greedy_margin(name):
    """Greedy top-1 should clearly beat top-2, so fp32 batching noise (~1e-5) never flips a token."""
    assert load_model(name, dtype=torch.bfloat16)[0].dtype == torch.bfloat16
    model, _ = load_model(name)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 260, (32, 16), generator=g)
    top2 = model(prompts).logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert gaps.median() > 0.1
    assert (gaps < 1e-3).float().mean() < 0.01


def test_tiny_tokenizer_roundtrip():
    tokenizer = tiny_tokenizer()
    text = "Hello, world! 123 {batching} ~end~"
    ids = tokenizer.encode(text)
    assert ids[0] == ord("H") + 4 and len(ids) == len(text)  # one token per byte, no BOS added
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer.encode("héllo ✓")) == "héllo ✓"  # multi-byte UTF-8 too
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    tokenizer.decode(list(range(512)))  # every id a random model can emit decodes


def test_load_model_tokenizer_pads_left():
    _, tokenizer = load_model("tiny-random-gpt2")
    batch = tokenizer(["a", "abc"], padding=True, return_tensors="pt")
    assert batch.input_ids.tolist() == [[0, 0, ord("a") + 4], [ord("a") + 4, ord("b") + 4, ord("c") + 4]]
    assert batch.attention_mask.tolist() == [[0, 0, 1], [1, 1, 1]]


def test_unknown_name_raises_listing_allowed_names():
    with pytest.raises(ValueError) as err:
        load_model("gpt-17-ultra")
    for name in MODEL_NAMES:
        assert name in str(err.value)


def test_local_directory_load(tmp_path):
    model, tokenizer = load_model("tiny-random-gpt2")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded, reloaded_tok = load_model(str(tmp_path))
    ids = torch.tensor([tokenizer.encode("abc")])
    assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert reloaded_tok.decode(reloaded_tok.encode("abc")) == "abc"


def test_conversion_is_atomic(tmp_path, monkeypatch):
    """An interrupted conversion leaves nothing behind; a finished one is what later loads read.

    Uses the tiny model in place of the GGUF so it runs in milliseconds.
    """
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(gguf, "load_smollm2_from_gguf", lambda: load_model("tiny-random-llama"))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(PreTrainedTokenizerFast, "save_pretrained", crash)
        with pytest.raises(KeyboardInterrupt):
            load_model("smollm2-135m")
    assert list(tmp_path.iterdir()) == []  # no half-written cache, no temp dir
    model, tokenizer = load_model("smollm2-135m")
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m-instruct"]
    reference, _ = load_model("tiny-random-llama")
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


# ----------------------------------------------------------------------------- SmolLM2-135M

PROMPT = "Once upon a time"


def greedy(model, tokenizer, n=6):
    enc = tokenizer(PROMPT, return_tensors="pt")
    return model.generate(**enc, max_new_tokens=n, do_sample=False)[0].tolist()


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer, greedy tokens); converts the GGUF on first use on this machine."""
    model, tokenizer = load_model("smollm2-135m")
    return model, tokenizer, greedy(model, tokenizer)


def test_smollm2_loads_and_generates_deterministically(smollm2):
    model, tokenizer, tokens = smollm2
    assert (smollm2_cache_path() / "model.safetensors").exists()
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert getattr(config, "quantization_config", None) is None
    assert not model.training and model.dtype == torch.float32
    assert tokens == greedy(model, tokenizer)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    assert text.startswith(PROMPT) and len(text) > len(PROMPT) + 10


def test_smollm2_second_load_uses_the_cache(smollm2, monkeypatch):
    """Once converted, loading never touches the GGUF again (that is what makes it take ~1 s)."""
    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF was read although the cache exists")

    monkeypatch.setattr(gguf, "load_smollm2_from_gguf", no_gguf)
    model, tokenizer = load_model("smollm2-135m")
    assert greedy(model, tokenizer) == smollm2[2]


def test_smollm2_cache_matches_gguf(smollm2):
    """The cache holds exactly the de-quantised GGUF weights, so greedy tokens agree too."""
    gguf_model, gguf_tokenizer = load_smollm2_from_gguf()
    cached = smollm2[0].state_dict()
    for k, v in gguf_model.state_dict().items():
        assert torch.equal(v, cached[k]), k
    assert greedy(gguf_model, gguf_tokenizer) == smollm2[2]
