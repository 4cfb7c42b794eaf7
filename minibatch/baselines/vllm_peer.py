"""vLLM as a peer on the same trace: ``compare --policies paged,vllm`` (``run_vllm``).

vLLM pins its own torch and transformers, so it usually lives in a virtual environment of its own (README, "vLLM as
a peer"; ``scripts/setup_vllm.sh``): ``--vllm-python PATH`` names that environment's interpreter. Without it,
this interpreter is used if it can import vllm; otherwise the run raises :class:`PeerUnavailable` and ``compare``
skips the row with one line saying so. Either way vLLM runs in a child process (``vllm_worker.py``, standard
library only), as vLLM itself starts its engine core in another process.

What vLLM is given, so the comparison is like for like:

* the same prompt token ids and max_new_tokens, greedy, our EOS ids as ``stop_token_ids`` unless a request
  ignores EOS (we detokenize nothing: ``skip_tokenizer_init``);
* the same dtype, max_num_seqs, KV cache bytes (``n_slots`` x the model's KV bytes per token, vLLM's
  ``kv_cache_memory_bytes``) and token budget (``max_num_batched_tokens``; vLLM always chunks prefills);
* prefix caching off unless ``--enable-prefix-caching`` (vLLM's default is on; our policies without "prefix" in
  their name do not cache prefixes);
* its default compiled mode (torch.compile, ``--enforce-eager`` turns it off), the model loaded and a warm-up run
  before the clock starts; requests submitted at their arrival times.

Per-request times: vLLM's offline API reports only each request's first and last token times, so the worker runs
the engine loop itself (``LLMEngine.add_request`` / ``step``) and stamps every token when the step that returns
it ends (frontend-observed, as a streaming client would see them). TTFT, TPOT and ITL then come from
``minibatch.metrics`` like any run's. Outputs go through the same equivalence rule as ours (fp32 exact, bf16
logprob-close against HF generate).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from minibatch.baselines.shared import check_requests, finish_request, max_model_len
from minibatch.checks import MAX_KV_SLOTS, MAX_NUM_SEQS, MAX_TOKENS
from minibatch.config import option
from minibatch.models import eos_token_ids
from minibatch.request import Request
from minibatch.scheduler.config import SchedulerConfig

WORKER = Path(__file__).with_name("vllm_worker.py")
WARMUP = [{"request_id": f"warmup-{i}", "prompt_token_ids": list(range(10 + i, 26 + i)), "max_tokens": 8,
           "ignore_eos": True, "arrival_time_s": 0.0} for i in range(2)]


class PeerUnavailable(RuntimeError):
    """The peer engine cannot run here (not installed, no interpreter given); ``compare`` skips its row."""


@dataclass(frozen=True)
class VllmConfig(SchedulerConfig):
    """What vLLM is configured with (vLLM's own names)."""

    max_num_seqs: int = option(8, "most requests running at once", "int", low=1, high=MAX_NUM_SEQS)
    n_slots: int = option(4096, "KV cache size, token slots", "int", low=1, high=MAX_KV_SLOTS)
    # vLLM's default token budget on a CPU (its chunked prefill is always on)
    max_num_batched_tokens: int = option(4096, "token budget per step: decodes first, then prompt chunks", "int",
                                         low=1, high=MAX_TOKENS)
    enable_prefix_caching: bool = option(False, "vllm: reuse cached prompt blocks (off unless given)", "bool")
    enforce_eager: bool = option(False, "vllm: run eagerly instead of its torch.compile'd model (compare's "
                                 "--enforce-eager, which our engine's runs take too)", "bool", cli=None)
    vllm_python: str | None = option(None, "vllm: the Python interpreter of an environment with vllm installed "
                                     "(default: this one, if it has vllm)", "path", optional=True)

    def __post_init__(self):
        super().__post_init__()
        problem = self.vllm_python is not None and interpreter_problem(self.vllm_python)
        if problem:  # given, but not an interpreter: a typo to fix now, not a peer to skip after the run
            raise ValueError(problem)


def interpreter_problem(path) -> str | None:
    """Why ``path`` (a ``--vllm-python``) cannot be run as an interpreter, or None when it can."""
    if not Path(path).is_file():
        return f"--vllm-python {path}: no such file"
    if not os.access(path, os.X_OK):
        return f"--vllm-python {path}: not executable (an environment's bin/python; scripts/setup_vllm.sh makes one)"
    return None


def lacks_vllm(path) -> str | None:
    """Why the interpreter ``path`` cannot import vllm, or None when it can (asked of it in a subprocess: a job
    that runs our side first learns it before, not after)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        done = subprocess.run([str(path), "-c", probe], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"--vllm-python {path}: cannot run it ({type(e).__name__})"
    return None if done.returncode == 0 else (f"--vllm-python {path}: not a Python with the vllm package "
                                              "(scripts/setup_vllm.sh makes an environment with it)")


def vllm_python(config: VllmConfig) -> str:
    """The interpreter that runs vLLM. Raises PeerUnavailable when there is none (the message says how to get one)."""
    if config.vllm_python is not None:
        problem = interpreter_problem(config.vllm_python)
        if problem:
            raise PeerUnavailable(problem)
        return str(config.vllm_python)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise PeerUnavailable("vllm is not installed in this environment and --vllm-python is not given "
                          "(README: vLLM as a peer; scripts/setup_vllm.sh)")


def model_directory(model, scratch: Path) -> str:
    """A directory vLLM can load ``model`` from: the one it was loaded from (config.json and safetensors in it),
    else ``model`` saved under ``scratch`` (a random-init test model)."""
    path = Path(str(getattr(model, "name_or_path", "") or ""))
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return str(path)
    out = scratch / "model"
    model.save_pretrained(out)
    return str(out)


def model_kv_bytes_per_token(model) -> int:
    """Bytes of K and V per token slot of ``model`` (all layers, its dtype), its geometry read as ModelRunner
    reads it."""
    from minibatch.kv.contiguous import kv_bytes_per_token
    from minibatch.runner.support import config_int

    cfg = model.config.get_text_config()
    heads = config_int(model, cfg, "num_attention_heads")
    head_dim = config_int(model, cfg, "head_dim", config_int(model, cfg, "hidden_size") // heads)
    return kv_bytes_per_token(config_int(model, cfg, "num_hidden_layers"),
                              config_int(model, cfg, "num_key_value_heads", heads), head_dim, model.dtype.itemsize)


def vllm_job(model, requests: list[Request], config: VllmConfig, model_dir: str) -> dict:
    """The worker's job (see ``vllm_worker.py``) for ``requests`` on ``model`` (its dtype and KV geometry).

    Raises:
        ValueError: a sampled request (the peer runs greedy traces, the ones whose outputs can be checked)."""
    kv_bytes = model_kv_bytes_per_token(model)
    eos = list(eos_token_ids(model))
    jobs = []
    for r in requests:
        if not r.sampling.is_greedy:
            raise ValueError(f"request {r.request_id!r} samples: the vllm peer runs greedy traces")
        jobs.append({"request_id": r.request_id, "prompt_token_ids": list(r.prompt_token_ids),
                     "max_tokens": r.max_new_tokens, "ignore_eos": True, "stop_token_ids": [] if
                     r.sampling.ignore_eos else eos, "logprobs": r.sampling.logprobs,
                     "arrival_time_s": r.arrival_time_s})
    longest = max(r.max_num_tokens for r in requests)
    limit = max_model_len(model)
    engine = dict(model=model_dir, dtype=str(model.dtype).removeprefix("torch."), skip_tokenizer_init=True,
                  max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                  kv_cache_memory_bytes=config.n_slots * kv_bytes,
                  max_model_len=longest if limit is None else min(limit, max(longest, 64)),
                  enable_prefix_caching=config.enable_prefix_caching, enforce_eager=config.enforce_eager, seed=0)
    return {"engine": engine, "env": {"VLLM_CONFIGURE_LOGGING": "0"}, "warmup": WARMUP, "requests": jobs}


def run_worker(python: str, job: dict, scratch: Path) -> dict:
    """Run ``job`` (see ``vllm_worker.py``) with ``python`` (an interpreter with vLLM), files in ``scratch``;
    returns its result. vLLM's processes get our engine's C allocator settings (``machine.peer_malloc_env``), so
    both engines reuse freed memory alike.

    Raises:
        RuntimeError: vLLM failed (the last lines of its output)."""
    from minibatch.machine import peer_malloc_env

    (scratch / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([python, str(WORKER), str(scratch / "job.json"), str(scratch / "result.json")],
                          capture_output=True, text=True, env=os.environ | peer_malloc_env())
    if proc.returncode != 0 or not (scratch / "result.json").is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"vllm exited with status {proc.returncode}:\n{tail}")
    return json.loads((scratch / "result.json").read_text())


def run_vllm(model, requests: list[Request], config: VllmConfig, progress: bool = False):
    """Run ``requests`` (fresh, not yet run) on vLLM, filling their tokens and time stamps like our engine's.
    Returns ``(requests, extra)``: extra holds vLLM's version, load, warm-up and run times and its settings.

    Raises:
        PeerUnavailable: no vLLM to run; ValueError: bad requests (as the HF baselines), a sampled request;
        RuntimeError: vLLM failed (the last lines of its output) or lost a request.
    """
    check_requests(model, requests, "vllm")
    python = vllm_python(config)
    with tempfile.TemporaryDirectory(prefix="minibatch-vllm-") as tmp:
        job = vllm_job(model, requests, config, model_directory(model, Path(tmp)))
        result = run_worker(python, job, Path(tmp))
    eos = eos_token_ids(model)
    for r in requests:
        got = result["requests"].get(r.request_id)
        if got is None or got["finish_reason"] is None:
            raise RuntimeError(f"request {r.request_id!r}: vllm returned no finished output")
        finish_request(r, got["output_token_ids"], got["token_times_s"], eos)
        r.logprobs = [{int(t): lp for t, lp in pos.items()} for pos in got["logprobs"]][: r.num_output_tokens]
    engine = {k: v for k, v in job["engine"].items() if k != "model"}
    return requests, {"peer": {"engine": "vllm", "version": result["vllm_version"], "python": python,
                               "load_s": round(result["load_s"], 1), "warmup_s": round(result["warmup_s"], 1),
                               "settings": engine, "token_times": "frontend-observed, once per LLMEngine.step"}}
