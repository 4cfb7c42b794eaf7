"""HF ``generate`` on each request alone: the reference outputs' generation (``minibatch.reference``).

Each request is a batch of one, without padding, through the unmodified model. On a CPU several requests run at
once, each on one torch thread (:func:`reference_workers` says why).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from minibatch.request import Request


def reference_workers(model, n_requests: int) -> int:
    """How many requests HF ``generate`` runs at once for the reference: on a CPU, one per torch thread (each on
    one thread), at most ``n_requests``; on a GPU one. Why: a batch-1 decode step is a chain of matrix-vector
    products, which torch's float32 GEMV runs at about the same speed on one thread as on two (10 GB/s on a 2-core
    AMD EPYC either way). There, 24 requests of compare's trace took 108.1 s one after another on two threads
    (``benchmarks/first_run.py`` at commit 6aa411f) and 81.3 s two at a time
    (``data/cpu/first_run_float32_24_requests.json``), with the same tokens."""
    return 1 if model.device.type != "cpu" else max(1, min(torch.get_num_threads(), n_requests))


@contextlib.contextmanager
def _one_thread_each():
    """torch's intra-op threads set to 1 inside the block (each worker's ops run on its own thread), restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _generate_one(model, r: Request, generation_config, logprobs: int):
    """HF ``generate`` on one request alone: its output token ids, or with ``logprobs`` a cache entry."""
    from minibatch.baselines import plain_generation
    from minibatch.runner.sampler import token_logprobs

    with torch.inference_mode():  # thread-local: a worker thread enters it itself
        ids = torch.tensor([r.prompt_token_ids], device=model.device)
        with plain_generation(model, generation_config(model, r)) as cfg:
            cfg.output_logits, cfg.return_dict_in_generate = logprobs > 0, True
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    if not logprobs:
        return tokens
    top = token_logprobs(torch.cat(out.logits), tokens, [logprobs] * len(tokens))
    return {"token_ids": tokens, "logprobs": [[[t, lp] for t, lp in p.items()] for p in top]}


def generate_alone(model, requests: list[Request], generation_config, progress: bool = False, logprobs: int = 0,
                   attention: str = "sdpa") -> list:
    """HF ``generate`` on each request alone (batch of one, no padding): per request its output token ids, or
    with ``logprobs`` > 0 a cache entry {"token_ids", "logprobs"}: at each position the ``logprobs`` most likely
    tokens and the chosen one with their logprobs (``runner.sampler.token_logprobs`` of generate's raw logits).
    ``generation_config(model, request)`` gives each call's GenerationConfig (applied with ``plain_generation``);
    ``attention``: the attention implementation the model runs with meanwhile.

    With several :func:`reference_workers`, that many threads take the requests longest first, each on one torch
    thread and its own shallow copy of the model (the weights shared; ``generation_config``, which
    ``plain_generation`` swaps, its own). Each request is still generated alone, by the same code."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    from minibatch.models import attention_implementation

    workers = reference_workers(model, len(requests))
    outputs: list = [None] * len(requests)
    with attention_implementation(model, attention), \
            tqdm(total=len(requests), desc="reference", disable=not progress, leave=False) as bar:
        if workers == 1:
            for i, r in enumerate(requests):
                outputs[i] = _generate_one(model, r, generation_config, logprobs)
                bar.update()
            return outputs
        free = [copy.copy(model) for _ in range(workers)]  # shares parameters, buffers and submodules

        def work(i):
            m = free.pop()  # list.pop is atomic: each running task holds its own copy
            try:
                outputs[i] = _generate_one(m, requests[i], generation_config, logprobs)
            finally:
                free.append(m)
                bar.update()

        order = sorted(range(len(requests)), key=lambda i: -requests[i].max_new_tokens)  # longest first
        with _one_thread_each(), ThreadPoolExecutor(workers, thread_name_prefix="minibatch-reference") as pool:
            list(pool.map(work, order))  # re-raises a worker's exception
    return outputs
