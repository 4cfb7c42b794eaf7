"""Baseline 2: transformers' own continuous batching (paged attention, a background generation thread).

The peer of our iteration-level engines. It has no virtual clock: requests are submitted at their real
arrival times, so a run takes as long as the trace. See :func:`run_hf_generate_batch` and the
``minibatch.baselines`` overview.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import time
from typing import Iterator

from minibatch.baselines.generation_config import plain_generation, plain_generation_config
from minibatch.baselines.shared import batch_sampling, check_requests, finish_request, progress_bar
from minibatch.models import attention_implementation, eos_token_ids
from minibatch.request import Request, RequestStatus


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
    sampling = batch_sampling(requests)
    if sampling is not None and sampling.seed is not None and "seed" in fields:
        kwargs["seed"] = sampling.seed
    return ContinuousBatchingConfig(**kwargs)


def _cb_generation_config(model, requests: list[Request]):
    """The run's GenerationConfig: the model's EOS ids by default (each request sets its own at
    ``add_request``), -1 for none (None makes HF warn and set -1 itself)."""
    eos = eos_token_ids(model)
    return plain_generation_config(model, max(r.max_new_tokens for r in requests), batch_sampling(requests),
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
        ValueError: empty input, duplicate ids, a used or too long request, one that sets a sampling field
            HF's continuous batching does not apply (min_tokens, logprobs, stop_token_ids:
            ``baselines.shared.UNSUPPORTED``), or max_batch_tokens < 1.
        RuntimeError: HF failed a request, lost one, or its generation thread died; a request's tokens and
            timestamps differ in number, or its tokens end early or run past its end.
    """
    check_requests(model, requests, "hf_generate_batch")
    if max_batch_tokens is not None and max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    eos = eos_token_ids(model)
    gen_config = _cb_generation_config(model, requests)
    cb_config = _cb_config(model, requests, max_batch_tokens)
    by_id = {r.request_id: r for r in requests}
    order = sorted(requests, key=lambda r: r.arrival_time_s)
    results: dict = {}
    bar = progress_bar(progress, len(requests), "hf-generate-batch")
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
        finish_request(r, tokens, [t - t0 for t in stamps], eos)
        if r.num_output_tokens != len(tokens):
            raise RuntimeError(f"request {r.request_id!r}: HF generated {len(tokens)} tokens past its end "
                               f"({r.num_output_tokens} kept)")
    return requests
