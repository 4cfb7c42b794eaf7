"""HF ``generate`` reference outputs -- the ground truth of ``matches_reference`` -- cached on disk.

:func:`reference_outputs` runs HF ``generate`` on each greedy request alone. With ``cache_dir`` the outputs are
kept there, so a run on the same model and trace skips the generate calls (12 of them for a default
``compare`` trace, about half a minute on a 2-core CPU).

**Cache layout.** One JSON file per *model key* (:func:`model_key`): everything outside the requests that can
change the outputs -- the model's fingerprint (:func:`model_fingerprint`: its files' sha256, or its tensors'
when it has no files), class, dtype, device type (and GPU name), the torch and transformers versions, the
attention used and this cache's format. The file is ``<cache_dir>/<sha256 of the key>.json`` and holds
``{"format", "key", "outputs": {request fingerprint: output token ids}}``; a request fingerprint
(:func:`request_fingerprint`) covers the prompt token ids, ``max_new_tokens``, the sampling parameters
(``ignore_eos`` included) and the exact ``GenerationConfig`` passed to ``generate`` (EOS and pad ids in it).
One file per model rather than per request: a trace that adds requests reuses the old ones, a run reads one
file and writes it at most once, and the cache does not grow into thousands of tiny files.

**Robustness.** A missing, corrupt, truncated or foreign cache file (wrong format or key) is ignored: its
requests are recomputed and the file rewritten. Invalid entries are recomputed one by one. Writes are atomic
(:mod:`minibatch.files`) and merge with what another run may have written meanwhile; a write that fails (read-only
or full disk) only warns. A model's fingerprint is computed once per model object (kept on it as an attribute)
and recomputed when its tensors are replaced or changed in place (tracked by storage pointers and version
counters); weights changed in memory *before* the first fingerprint of a model loaded from files are not seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path

import torch

from minibatch.equivalence import ReferenceOutput
from minibatch.request import Request

CACHE_FORMAT = 1
REFERENCE_ATTENTION = "sdpa"  # the attention HF generate runs with for the reference
# Files of a model directory whose bytes can change the outputs: weights (also GGUF) and configs (.json: config,
# generation_config, shard index; tokenizer .json files are hashed too, harmless: the requests are token ids).
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".json")
_FINGERPRINT_ATTR = "_minibatch_reference_fingerprint"
_CHUNK_BYTES = 1 << 20


def default_cache_dir() -> Path:
    """Where ``compare`` keeps reference outputs: ``reference`` under the package's cache folder
    (``$MINIBATCH_CACHE``, else ``~/.cache/minibatch``; see ``hf_load.cache_dir``). Creates nothing."""
    from minibatch.hf_load import cache_dir

    return cache_dir() / "reference"


# ----------------------------------------------------------------------------- fingerprints

def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (a model-sized file never sits in memory).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


def model_files(path: str | Path) -> list[Path]:
    """The files of a local model that hold weights or configs: ``path`` itself if it is a file (a GGUF), else
    the top-level files of the folder ``path`` ending in MODEL_FILE_SUFFIXES, sorted. [] for a folder without
    weight files or a path that does not exist."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []
    files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(MODEL_FILE_SUFFIXES))
    return files if any(not f.name.endswith(".json") for f in files) else []


def state_dict_sha256(model) -> str:
    """Hex sha256 over ``model.state_dict()``: each tensor's name, dtype, shape and bytes (GPU tensors are copied
    to the CPU one at a time)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
    return h.hexdigest()


def _model_source(model, model_name: str | None) -> Path | None:
    """The local file or folder the model's weights came from (``model_name``, else ``model.name_or_path``), or
    None (built in memory, a hub id, or weights copied in from another model at load: ``config.embedding_from``)."""
    if getattr(model.config, "embedding_from", None):
        return None
    for name in (model_name, getattr(model, "name_or_path", None)):
        if isinstance(name, (str, os.PathLike)) and str(name).strip() and model_files(Path(name).expanduser()):
            return Path(name).expanduser().resolve()
    return None


def _tensor_stamp(model) -> tuple:
    """Cheap identity of the model's current tensors: storage pointers and in-place version counters (changes when
    a tensor is replaced -- ``model.to(dtype)``, ``load_state_dict`` -- or modified in place; inference-mode tensors
    have no version counter, so only their replacement shows)."""
    return tuple((name, t.data_ptr(), -1 if t.is_inference() else t._version)
                 for name, t in model.state_dict(keep_vars=True).items())


def model_fingerprint(model, model_name: str | None = None) -> dict:
    """What identifies the model's weights, computed once per model object (kept on it as an attribute).

    Loaded from local files (``model_name`` or ``model.name_or_path`` is a model folder or file):
    ``{"files": {file name: sha256}, "config_sha256"}``; otherwise, or once its tensors changed after the first
    fingerprint: ``{"state_dict_sha256", "config_sha256"}``. ``config_sha256`` is over
    ``model.config.to_json_string()``. Cost: one read of the weights (~0.3 s for 500 MB).
    """
    stamp = _tensor_stamp(model)
    source = _model_source(model, model_name)
    saved = model.__dict__.get(_FINGERPRINT_ATTR)
    if saved is not None and saved["stamp"] == stamp and saved["source"] == source:
        return saved["fingerprint"]
    origin = saved["origin"] if saved is not None else stamp  # the tensors as first seen: as loaded, we assume
    fingerprint = {"config_sha256": hashlib.sha256(model.config.to_json_string().encode()).hexdigest()}
    if source is not None and stamp == origin:  # files describe the weights only as loaded
        fingerprint["files"] = {f.name: file_sha256(f) for f in model_files(source)}
    else:
        fingerprint["state_dict_sha256"] = state_dict_sha256(model)
    model.__dict__[_FINGERPRINT_ATTR] = {"origin": origin, "stamp": stamp, "source": source, "fingerprint": fingerprint}
    return fingerprint


def model_key(model, model_name: str | None = None) -> dict:
    """Everything besides the request that can change a reference output: the model fingerprint, class, dtype,
    device type (and GPU name), torch and transformers versions, the attention used and the cache format."""
    import transformers

    device = model.device
    key = {"format": CACHE_FORMAT, "model": model_fingerprint(model, model_name), "class": type(model).__name__,
           "dtype": str(model.dtype), "device": device.type, "torch": torch.__version__,
           "transformers": transformers.__version__, "attention": REFERENCE_ATTENTION}
    if device.type == "cuda":
        key["gpu"] = torch.cuda.get_device_name(device)
    return key


def _generation_config(model, r: Request):
    from minibatch.baselines import plain_generation_config

    return plain_generation_config(model, r.max_new_tokens, r.sampling)


def request_fingerprint(model, r: Request, logprobs: int = 0) -> str:
    """Hex sha256 of what of ``r`` changes its reference: prompt token ids, max_new_tokens, sampling parameters
    (ignore_eos too; not ``logprobs``, which changes no token), the full GenerationConfig given to ``generate``
    (the model's EOS and pad ids in it) and the top logprobs kept per position (when > 0)."""
    sampling = {k: v for k, v in dataclasses.asdict(r.sampling).items() if k != "logprobs"}
    fields = {"prompt_token_ids": list(r.prompt_token_ids), "max_new_tokens": r.max_new_tokens,
              "sampling": sampling,
              "generation_config": json.loads(_generation_config(model, r).to_json_string(use_diff=False))}
    if logprobs:
        fields["top_logprobs"] = logprobs
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def cache_path(cache_dir: str | Path, key: dict) -> Path:
    """The cache file of ``key`` (:func:`model_key`) in ``cache_dir``: ``<sha256 of the key>.json``."""
    return Path(cache_dir) / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()}.json"


# ----------------------------------------------------------------------------- cache file

def _is_token_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)


def _is_entry(x) -> bool:
    """A cached output: token ids, or {"token_ids", "logprobs": per position [[token id, logprob], ...]}."""
    if isinstance(x, dict):
        lps = x.get("logprobs")
        return (_is_token_list(x.get("token_ids")) and isinstance(lps, list) and len(lps) == len(x["token_ids"])
                and all(isinstance(p, list) and all(isinstance(e, list) and len(e) == 2 for e in p) for p in lps))
    return _is_token_list(x)


def read_cache(path: str | Path, key: dict) -> dict[str, list[int]]:
    """The outputs stored at ``path`` for ``key``: request fingerprint -> output token ids. {} if the file is
    missing, unreadable, corrupt, of another format or another key; invalid entries are left out. Never raises."""
    from minibatch.files import read_json

    try:
        data = read_json(path, "reference cache")
    except ValueError:
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or data.get("key") != key:
        return {}
    outputs = data.get("outputs")
    if not isinstance(outputs, dict):
        return {}
    return {fp: entry for fp, entry in outputs.items() if _is_entry(entry)}


def write_cache(path: str | Path, key: dict, outputs: dict[str, list[int]]) -> bool:
    """Add ``outputs`` (request fingerprint -> token ids) to the cache file ``path`` of ``key``, merged with what
    it holds now (another run may have added some), atomically. Returns False, with a warning, if the file cannot
    be written (the run goes on without the cache)."""
    from minibatch.files import write_json

    merged = {**read_cache(path, key), **outputs}
    try:
        write_json(path, {"format": CACHE_FORMAT, "key": key, "outputs": merged}, indent=None)
    except OSError as e:
        warnings.warn(f"reference cache not saved: {e}", RuntimeWarning, stacklevel=3)
        return False
    return True


# ----------------------------------------------------------------------------- references

@torch.inference_mode()
def reference_outputs(model, requests: list[Request], progress: bool = False, cache_dir: str | Path | None = None,
                      model_name: str | None = None, logprobs: int = 0) -> dict:
    """HF ``generate`` on each greedy request alone: the ground truth for matches_reference.

    Greedy, ``max_new_tokens``, stopping at the model's EOS unless ``ignore_eos``, and nothing else:
    the checkpoint's generation_config (repetition_penalty, suppress_tokens, ...) is left out
    (``baselines.plain_generation_config``), since our engine implements none of it.
    Requests that are not greedy are skipped. Returns request_id -> output token ids; with ``logprobs``
    > 0, request_id -> :class:`~minibatch.equivalence.ReferenceOutput` (token ids and, per position, the
    ``logprobs`` most likely tokens with their logprobs: what the logprob-close rule needs).

    Args:
        cache_dir: a folder (e.g. :func:`default_cache_dir`) where outputs are looked up and stored (see the
            module docstring for the key); None computes every request.
        model_name: where the model was loaded from (a local folder or file), when ``model.name_or_path`` does
            not say; only used to find the files to fingerprint.

    Raises:
        ValueError: ``cache_dir`` is not a path.
    """
    from minibatch.baselines.alone import generate_alone

    if cache_dir is not None and (not isinstance(cache_dir, (str, os.PathLike)) or not str(cache_dir).strip()):
        raise ValueError(f"cache_dir must be a folder path or None, got {cache_dir!r}")
    greedy = [r for r in requests if r.sampling.is_greedy]
    fingerprints = {r.request_id: request_fingerprint(model, r, logprobs) for r in greedy}
    todo = list({fingerprints[r.request_id]: r for r in greedy}.items())
    key = path = None
    cached = {}
    if cache_dir is not None:
        key = model_key(model, model_name)
        path = cache_path(cache_dir, key)
        cached = read_cache(path, key)
        todo = [(fp, r) for fp, r in todo if fp not in cached]
    new = dict(zip([fp for fp, _ in todo], generate_alone(model, [r for _, r in todo], _generation_config, progress,
                                                          logprobs, REFERENCE_ATTENTION)))
    if new and path is not None:
        write_cache(path, key, new)
    outputs = {**cached, **new}
    entries = {r.request_id: outputs[fingerprints[r.request_id]] for r in greedy}
    if not logprobs:
        return {rid: list(e) for rid, e in entries.items()}
    return {rid: ReferenceOutput(list(e["token_ids"]), [{int(t): float(lp) for t, lp in p} for p in e["logprobs"]])
            for rid, e in entries.items()}
