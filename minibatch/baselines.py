"""Outside baselines for ``python -m minibatch compare``: Hugging Face's own ways to serve a trace.

Both run the unmodified model on the wall clock and fill the same :class:`~minibatch.request.Request`
stamps our engine fills (``first_scheduled_time_s``, ``token_times_s``, ``finish_time_s``,
``output_token_ids``, ``finish_reason``), in seconds from the trace start, so ``minibatch.metrics``
reads them like any engine run (TTFT = ``token_times_s[0] - arrival_time_s``, ...).

* :func:`run_hf_generate`: ``model.generate`` on left-padded *static* batches, formed by the same rule
  as our :class:`~minibatch.scheduler.static.StaticScheduler`. Time is a virtual timeline like our
  ``WallClock``: it advances by the measured duration of each ``generate`` call and jumps over idle
  gaps (nothing is slept through), so the run takes only as long as the compute.
* :func:`run_hf_generate_batch`: transformers' own continuous batching (paged attention, a background
  generation thread), the peer of our iteration-level engines. It has no virtual clock: requests are
  submitted at their real arrival times, so it takes as long as the trace.

Both mutate the requests they are given (pass ``[r.copy() for r in reqs]`` to reuse a trace) and
return them in the same order. Neither drops a request: bad input raises ``ValueError``, a request
HF fails or loses raises ``RuntimeError`` naming it.

Both do only what our engine does: the checkpoint's generation_config (repetition_penalty,
no_repeat_ngram_size, suppress_tokens, sampling defaults, ...) is replaced by
:func:`plain_generation_config` inside :func:`plain_generation`, as in ``compare.reference_outputs``.

Limits of the HF APIs (documented, not hidden):

* one sampling setting per call: ``generate`` samples a whole batch with one temperature/top-k/top-p
  and the global torch RNG, so per-request ``seed`` cannot be honoured. We use the first sampled
  request's parameters for the batch (``run_hf_generate``) or the run (``run_hf_generate_batch``), seed
  the RNG with its seed inside ``torch.random.fork_rng`` (the caller's RNG stream is untouched), and a
  greedy request in a sampled batch is sampled too. Greedy-only traces are exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import time
from typing import Iterator

import torch

from minibatch.models import attention_implementation, eos_token_ids, pad_token_id
from minibatch.request import Request, RequestStatus, SamplingParams

__all__ = ["plain_generation", "plain_generation_config", "run_hf_generate", "run_hf_generate_batch"]


# ----------------------------------------------------------------------------- shared helpers

def _max_model_len(model) -> int | None:
    """The model's context limit, read as ModelRunner reads it (None: its config sets none)."""
    from minibatch.runner.support import NO_POSITION_LIMIT, config_max_model_len

    max_len = config_max_model_len(model.config.get_text_config())
    return None if max_len == NO_POSITION_LIMIT else max_len


def _fitting_batch(candidates: list[Request], max_len: int | None) -> list[Request]:
    """The longest FCFS prefix of ``candidates`` that fits the model's positions as one padded batch.

    HF ``generate`` advances every row's position on every step, finished rows too, so the row with
    the longest prompt reaches position longest prompt + steps - 1, and a batch runs up to its
    longest max_new_tokens steps: it fits when longest prompt + longest max_new_tokens <= max_len
    (``max_len`` None: no limit). Every request fits alone (``_check_requests``), so the prefix has
    at least one.
    """
    longest_prompt = longest_new = 0
    for n, r in enumerate(candidates):
        longest_prompt, longest_new = max(longest_prompt, r.num_prompt_tokens), max(longest_new, r.max_new_tokens)
        if n and max_len is not None and longest_prompt + longest_new > max_len:
            return candidates[:n]
    return candidates


def _check_requests(model, requests: list[Request]) -> None:
    """ValueError on empty input, duplicate ids, used requests or requests too long for the model."""
    if not requests:
        raise ValueError("requests is empty: give at least one Request")
    seen: set[str] = set()
    for r in requests:
        if r.request_id in seen:
            raise ValueError(f"duplicate request_id {r.request_id!r}")
        seen.add(r.request_id)
        if r.status != RequestStatus.WAITING or r.num_computed_tokens or r.output_token_ids:
            raise ValueError(f"request {r.request_id!r} already ran; pass request.copy()")
    max_len = _max_model_len(model)
    if max_len is not None:
        for r in requests:
            if r.max_num_tokens > max_len:
                raise ValueError(
                    f"request {r.request_id!r}: prompt ({r.num_prompt_tokens}) + max_new_tokens "
                    f"({r.max_new_tokens}) must be <= max_model_len ({max_len})"
                )


def _batch_sampling(requests: list[Request]) -> SamplingParams | None:
    """The one sampling setting HF can apply to a whole batch: the first sampled request's (None = greedy)."""
    return next((r.sampling for r in requests if not r.sampling.is_greedy), None)


# GenerationConfig fields that change the tokens or the work, at the value that turns them off (fields
# present in transformers 5.17 and later). The rest (forced_bos_token_id, suppress_tokens, bad_words_ids,
# sequence_bias, min_new_tokens, min_p, stop_strings, watermarking_config, cache_implementation, ...) are
# off at None, which ``plain_generation`` keeps from being refilled from the checkpoint's generation_config.
NEUTRAL_GENERATION_FIELDS = dict(
    num_beams=1, num_return_sequences=1, min_length=0, repetition_penalty=1.0,
    encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, length_penalty=1.0,
    typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, remove_invalid_values=False, renormalize_logits=False,
    use_cache=True,
)


def plain_generation_config(model, max_new_tokens: int, sampling: SamplingParams | None = None, **overrides):
    """A fresh ``GenerationConfig`` doing only what our engine does, nothing from the checkpoint's.

    It carries ``max_new_tokens``; greedy (``sampling`` None or greedy: ``do_sample=False``) or
    ``do_sample=True`` with ``sampling``'s temperature, top_k (0 = off) and top_p; the model's EOS
    ids (``models.eos_token_ids``) unless ``sampling.ignore_eos`` (then None: no EOS stop); the
    model's ``pad_token_id``. Every other field that changes the tokens is off
    (``NEUTRAL_GENERATION_FIELDS``, the rest None). Pass it to ``generate`` inside
    :func:`plain_generation`, or to transformers' continuous batching (which reads it as is).

    Args:
        model: an HF causal LM (read for its EOS and pad ids only).
        max_new_tokens: tokens to generate, >= 1.
        sampling: the :class:`~minibatch.request.SamplingParams` to map (None: greedy, EOS on).
        overrides: GenerationConfig fields set last (e.g. ``eos_token_id=-1``).

    Raises:
        TypeError: an override that is not a GenerationConfig field.
    """
    from transformers import GenerationConfig

    unknown = sorted(k for k in overrides if not hasattr(GenerationConfig(), k))
    if unknown:
        raise TypeError(f"plain_generation_config: {unknown} are not GenerationConfig fields")
    fields = dict(NEUTRAL_GENERATION_FIELDS, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id(model))
    eos = eos_token_ids(model)
    fields["eos_token_id"] = None if (sampling is not None and sampling.ignore_eos) or not eos else list(eos)
    if sampling is None or sampling.is_greedy:
        fields["do_sample"] = False
    else:
        fields.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    fields.update(overrides)
    return GenerationConfig(**fields)


@contextlib.contextmanager
def plain_generation(model, generation_config):
    """``model.generation_config`` is ``generation_config`` inside the block (restored on exit, also on error).

    ``model.generate(..., generation_config=cfg)`` fills every field ``cfg`` leaves at None from
    ``model.generation_config`` (the checkpoint's generation_config.json), then from transformers'
    global defaults; for some fields (forced_bos_token_id, suppress_tokens, bad_words_ids, ...) None
    is the only value that turns them off, so a fresh config alone cannot keep them out. With the
    model's own config swapped for ``cfg`` nothing of the checkpoint's is left to fill in. Yields
    ``generation_config``. Not for a model that another thread generates with meanwhile.
    """
    saved = model.generation_config
    model.generation_config = generation_config
    try:
        yield generation_config
    finally:
        model.generation_config = saved


def _finish(r: Request, tokens: list[int], times: list[float], eos: tuple[int, ...]) -> None:
    """Fill ``r`` from its raw generated tokens and their times: cut at its own EOS or max_new_tokens."""
    if not r.sampling.ignore_eos:
        r.eos_token_ids = eos
    for tok, t in zip(tokens, times):
        r.append_token(tok)  # sets finish_reason / status at EOS (unless ignore_eos) or max_new_tokens
        r.token_times_s.append(t)
        if r.is_finished:
            break
    if not r.is_finished:
        raise RuntimeError(
            f"request {r.request_id!r}: HF returned {len(r.output_token_ids)} tokens, neither EOS nor "
            f"max_new_tokens ({r.max_new_tokens})"
        )
    # KV computed: the prompt, then one token per decode step (the last sampled token is never fed back)
    r.num_computed_tokens = r.num_prompt_tokens + r.num_output_tokens - 1
    r.finish_time_s = r.token_times_s[-1]


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' logging at error level and its progress bars off; both restored on exit.

    Continuous batching logs to its own "ContinuousBatchingLogger" (not under "transformers"), with
    its own handler: it gets the error level too.
    """
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    cb_level = cb_logger.level
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cb_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        cb_logger.setLevel(cb_level)
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _frozen_gc() -> Iterator[None]:
    """Move every object alive now out of the garbage collector's sight (``gc.freeze``), back on exit.

    HF's manager calls ``gc.collect()`` twice when it stops, to free its cache; with transformers and
    torch loaded a full collection walks millions of objects (~0.3 s each on a CPU). Frozen objects
    are skipped, so the collections only walk what the run created -- which still frees the cache.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _progress(progress: bool, total: int, desc: str):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- 1. static batches, model.generate

class _StepRecorder:
    """A ``StoppingCriteria`` that stamps every generation step and stops each row on its own terms.

    HF calls stopping criteria once per step, after the step's token is appended to ``input_ids``
    (the first call ends the prefill). We read the new tokens (a device sync on CUDA, so the stamp is
    taken once the step's work is done), record ``time.perf_counter()``, and mark a row done at its
    own EOS (unless ``ignore_eos``) or its own ``max_new_tokens``: generation stops when every row is
    done, exactly like a static batch; done rows keep computing until then (the honest static cost).
    """

    def __init__(self, requests: list[Request], eos: tuple[int, ...]):
        self.requests = requests
        self.eos = set(eos)
        self.times: list[float] = []
        self.done = [False] * len(requests)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        last = input_ids[:, -1].tolist()  # syncs with the device
        self.times.append(time.perf_counter())
        step = len(self.times)
        for i, (r, tok) in enumerate(zip(self.requests, last)):
            if not self.done[i]:
                self.done[i] = step >= r.max_new_tokens or (not r.sampling.ignore_eos and tok in self.eos)
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)


def _make_stopping_criteria(requests: list[Request], eos: tuple[int, ...]):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepRecorder(_StepRecorder, StoppingCriteria):
        pass

    recorder = StepRecorder(requests, eos)
    return recorder, StoppingCriteriaList([recorder])


def _generate_static_batch(model, batch: list[Request], start_s: float, eos: tuple[int, ...], pad_id: int) -> float:
    """One padded ``model.generate`` call; stamps ``batch`` on the timeline from ``start_s``; returns its duration."""
    device = model.device
    recorder, criteria = _make_stopping_criteria(batch, eos)
    sampling = _batch_sampling(batch)  # one setting for the batch (see the module docstring)
    # EOS is handled per row by `recorder` (a row with ignore_eos must not stop at EOS): no EOS in the config
    gen_config = plain_generation_config(model, max(r.max_new_tokens for r in batch), sampling,
                                         eos_token_id=None, pad_token_id=pad_id)
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices, enabled=sampling is not None):
        if sampling is not None and sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        _sync(device)
        t0 = time.perf_counter()
        max_len = max(r.num_prompt_tokens for r in batch)
        ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), max_len), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every row's last token is real
            ids[i, max_len - r.num_prompt_tokens:] = torch.tensor(r.prompt_token_ids)
            mask[i, max_len - r.num_prompt_tokens:] = 1
        with plain_generation(model, gen_config):
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 generation_config=gen_config, stopping_criteria=criteria)
        generated = out[:, max_len:].tolist()
        _sync(device)
        duration = time.perf_counter() - t0
    times = [start_s + (t - t0) for t in recorder.times]
    if any(len(row) != len(times) for row in generated):
        raise RuntimeError(f"HF generate returned {len(generated[0])} tokens for {len(times)} recorded steps")
    for r, row in zip(batch, generated):
        r.first_scheduled_time_s = start_s
        _finish(r, row, times, eos)
    return duration


def run_hf_generate(model, requests: list[Request], batch_size: int = 8, max_wait_s: float = 1.0,
                    progress: bool = False) -> list[Request]:
    """HF ``model.generate`` on padded static batches, measured on a virtual wall-clock timeline.

    Batches form as in our ``StaticScheduler``: requests queue FCFS by arrival; a batch of up to
    ``batch_size`` starts once ``batch_size`` have arrived or the oldest has waited ``max_wait_s``, and
    only after the previous ``generate`` returned. A batch also ends before the first request that
    would take it past the model's positions (see :func:`_fitting_batch`), which then heads the next
    batch. Prompts are left-padded (with an attention mask)
    and the batch generates ``max(max_new_tokens)`` steps unless every row finished earlier; each
    request keeps only its own tokens (cut at its EOS unless ``ignore_eos``, or its ``max_new_tokens``)
    and finishes at its own last token while the rest of the batch keeps computing.

    Time: ``now`` starts at 0, advances by each ``generate`` call's measured duration and jumps over
    idle gaps to the next arrival or batch wake time. The k-th token of every row is stamped with the
    end of generation step k (step 1 is the prefill), mapped onto that timeline.

    The model runs with transformers' SDPA attention during the call (the previous implementation is
    restored after) under ``torch.inference_mode``. Sampling: see the module docstring.

    Args:
        model: an HF causal LM (any device/dtype).
        requests: fresh requests (``request.copy()``) with unique ids; filled in place.
        batch_size: the most requests in one batch, >= 1.
        max_wait_s: start a partial batch once the oldest waiting request waited this long, >= 0.
        progress: show a tqdm bar over finished requests.

    Returns:
        ``requests``, same order, with outputs and time stamps.

    Raises:
        ValueError: empty input, duplicate ids, a request that already ran or is longer than the
            model's context, batch_size < 1 or max_wait_s < 0.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not max_wait_s >= 0:
        raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
    _check_requests(model, requests)
    eos, pad_id, max_len = eos_token_ids(model), pad_token_id(model), _max_model_len(model)
    pending = sorted(requests, key=lambda r: r.arrival_time_s)  # stable: ties keep input order (FCFS)
    bar = _progress(progress, len(requests), "hf-generate")
    now, nxt = 0.0, 0  # virtual clock; pending[nxt:] have not been admitted yet
    waiting: list[Request] = []
    with attention_implementation(model, "sdpa"), torch.inference_mode():
        while waiting or nxt < len(pending):
            while nxt < len(pending) and pending[nxt].arrival_time_s <= now:
                waiting.append(pending[nxt])
                nxt += 1
            if not waiting:
                now = pending[nxt].arrival_time_s  # idle: jump to the next arrival
                continue
            wake_s = waiting[0].arrival_time_s + max_wait_s
            if len(waiting) < batch_size and now < wake_s:  # wait for a fuller batch (or the wake time)
                now = min(wake_s, pending[nxt].arrival_time_s) if nxt < len(pending) else wake_s
                continue
            batch = _fitting_batch(waiting[:batch_size], max_len)
            waiting = waiting[len(batch):]
            for r in batch:
                r.status = RequestStatus.RUNNING
            now += _generate_static_batch(model, batch, now, eos, pad_id)
            if bar is not None:
                bar.update(len(batch))
    if bar is not None:
        bar.close()
    return requests


# ----------------------------------------------------------------------------- 2. HF continuous batching

# On CPU, transformers sizes the paged cache from free RAM (60% of it) with max_batch_tokens=8192, and
# builds a static (max_batch_tokens x (cache tokens + max_batch_tokens)) attention mask: ~4 GB filled
# at every start, ~20 s of overhead on a tiny model. We size the cache for the workload instead.
CPU_PAGE_SIZE = 32
CPU_MAX_BATCH_TOKENS = 512


def _cb_config(model, requests: list[Request], max_batch_tokens: int | None):
    """A ContinuousBatchingConfig for this run (transformers 5.17 calls the page size ``block_size``)."""
    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kwargs: dict = {}
    if model.device.type == "cpu":
        page = CPU_PAGE_SIZE
        kwargs["page_size" if "page_size" in fields else "block_size"] = page
        # room for every request at once (+1 page each for rounding): no eviction, a small mask
        kwargs["num_blocks"] = sum(math.ceil(r.max_num_tokens / page) + 1 for r in requests)
        kwargs["max_batch_tokens"] = max_batch_tokens or CPU_MAX_BATCH_TOKENS
    elif max_batch_tokens is not None:  # on an accelerator HF sizes the cache from free memory
        kwargs["max_batch_tokens"] = max_batch_tokens
    sampling = _batch_sampling(requests)
    if sampling is not None and sampling.seed is not None and "seed" in fields:
        kwargs["seed"] = sampling.seed
    return ContinuousBatchingConfig(**kwargs)


def _cb_generation_config(model, requests: list[Request]):
    """The run's GenerationConfig: the model's EOS ids by default (each request sets its own at
    ``add_request``), -1 for none (None makes HF warn and set -1 itself)."""
    eos = eos_token_ids(model)
    return plain_generation_config(model, max(r.max_new_tokens for r in requests), _batch_sampling(requests),
                                   eos_token_id=list(eos) if eos else -1)


def run_hf_generate_batch(model, requests: list[Request], progress: bool = False,
                          max_batch_tokens: int | None = None) -> list[Request]:
    """transformers' continuous batching (paged attention), submitting each request at its arrival.

    The peer of our iteration-level engines. A manager (``model.continuous_batching_context_manager``)
    runs the generation loop in a background thread; this thread sleeps until ``t0 + arrival_time_s``
    and adds each request (``eos_token_id=-1`` for ``ignore_eos``, else the model's EOS ids), then
    collects the results. ``t0`` is taken once the manager has started (its setup is not on the
    timeline, like our engines' setup). It runs in *real time*: a trace spanning 60 s takes 60 s.

    Stamps, in seconds since ``t0``: ``token_times_s`` from HF's per-token ``perf_counter`` timestamps
    (``record_timestamps=True``), ``finish_time_s`` the last of them, ``first_scheduled_time_s`` when
    HF's scheduler first took the request.

    Attention: the model is put in SDPA first (our packed engines may have left a custom
    implementation) and HF switches it to what it wants for continuous batching (5.23 keeps "sdpa",
    5.17 uses "paged|sdpa"; both switch to flash attention when it is installed); the previous
    implementation is restored after. transformers' logging is at error level during the call.

    Cache: on CPU the paged cache is sized for the workload (pages of ``CPU_PAGE_SIZE`` tokens, room
    for every request at once, ``max_batch_tokens`` default ``CPU_MAX_BATCH_TOKENS``); HF's
    default (60% of RAM) costs ~20 s per call. On an accelerator HF sizes it from free memory.

    Args:
        model: an HF causal LM supporting continuous batching (Llama, GPT-2, ...).
        requests: fresh requests with unique ids; filled in place. Sampling: see the module docstring.
        progress: show a tqdm bar over finished requests.
        max_batch_tokens: tokens per forward (HF's ``ContinuousBatchingConfig.max_batch_tokens``).

    Returns:
        ``requests``, same order, with outputs and time stamps.

    Raises:
        ValueError: empty input, duplicate ids, a used or too long request.
        RuntimeError: HF failed a request, lost one, or its generation thread died.
    """
    _check_requests(model, requests)
    if max_batch_tokens is not None and max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    eos = eos_token_ids(model)
    gen_config = _cb_generation_config(model, requests)
    cb_config = _cb_config(model, requests, max_batch_tokens)
    by_id = {r.request_id: r for r in requests}
    order = sorted(requests, key=lambda r: r.arrival_time_s)
    results: dict = {}
    bar = _progress(progress, len(requests), "hf-generate-batch")
    # No torch.inference_mode here: HF makes its static tensors in this thread and updates them in place
    # in its generation thread, which inference tensors forbid (HF runs the model under no_grad itself).
    with (_quiet_transformers(), attention_implementation(model, "sdpa"), _frozen_gc(),
          plain_generation(model, gen_config)):
        with model.continuous_batching_context_manager(generation_config=gen_config, block=True, timeout=60,
                                                       continuous_batching_config=cb_config) as manager:
            t0 = time.perf_counter()
            for r in order:
                delay = t0 + r.arrival_time_s - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                added = manager.add_request(
                    input_ids=list(r.prompt_token_ids),
                    request_id=r.request_id,
                    max_new_tokens=r.max_new_tokens,
                    record_timestamps=True,
                    eos_token_id=-1 if r.sampling.ignore_eos or not eos else list(eos),
                )
                if added is None:
                    raise RuntimeError(f"HF continuous batching refused request {r.request_id!r} "
                                       "(its generation thread stopped)")
                r.status = RequestStatus.RUNNING
            while len(results) < len(requests):
                out = manager.get_result(timeout=0.5)
                if out is None:
                    if not manager.is_running():
                        break
                    continue
                if out.request_id not in by_id or not out.is_finished():
                    continue
                results[out.request_id] = out
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    missing = [r.request_id for r in requests if r.request_id not in results]
    if missing:
        raise RuntimeError(f"HF continuous batching returned no result for requests {missing}")
    for r in requests:
        out = results[r.request_id]
        if out.error is not None:
            raise RuntimeError(f"HF continuous batching failed request {r.request_id!r}: {out.error}")
        tokens, stamps = list(out.generated_tokens), list(out.timestamps or [])
        if len(stamps) != len(tokens):
            raise RuntimeError(f"request {r.request_id!r}: {len(tokens)} tokens but {len(stamps)} timestamps")
        start = out.lifespan[0] if out.lifespan and out.lifespan[0] > 0 else None
        r.first_scheduled_time_s = None if start is None else start - t0
        _finish(r, tokens, [t - t0 for t in stamps], eos)
        if r.num_output_tokens != len(tokens):
            raise RuntimeError(f"request {r.request_id!r}: HF generated {len(tokens)} tokens past its end "
                               f"({r.num_output_tokens} kept)")
    return requests
