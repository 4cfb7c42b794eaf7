"""Recompute vs swap when paged KV blocks run out (vLLM, Kwon et al. SOSP'23 §4.5), for notebook 04 and
``benchmarks/paged_kv.py``: the same trace under "paged" with each preemption mode, as plain dicts."""

from __future__ import annotations

from typing import Callable

from minibatch.engine import StepRecord
from minibatch.experiment import run, same_outputs
from minibatch.experiments.paged_kv import num_prefill_tokens, run_metrics
from minibatch.request import Request


def recomputed_tokens(trace: list[StepRecord], requests: list[Request]) -> int:
    """Tokens computed again after a recompute preemption: each request's prefill tokens over
    the trace beyond its prompt (prefix caching off; a preempted request prefills its prompt
    and the tokens it had generated again)."""
    prefill = num_prefill_tokens(trace)
    return sum(prefill.get(r.request_id, 0) - r.num_prompt_tokens for r in requests)


def preemption_experiment(requests: list[Request], executor, clock_factory: Callable, n_slots: int,
                          modes=("recompute", "swap"), max_num_seqs: int = 32, block_size: int = 16) -> dict:
    """The same trace under "paged" with each preemption mode (vLLM §4.5), in ``n_slots`` slots
    small enough that running requests run out of blocks.

    recompute: the victim's blocks are freed; it later prefills prompt + generated tokens again.
    swap: its blocks are copied to CPU memory and back (as many CPU blocks as GPU blocks; if they
    run out the victim is recomputed instead).
    clock_factory: a fresh clock per run, e.g. ``SimClock`` or ``WallClock``.
    Returns {"n_slots", "block_size", "max_num_seqs", "modes": {mode: run_metrics + recomputed_tokens,
    num_preempted_requests, num_blocks_swapped_out/in, swapped_bytes (None without a model)},
    "same_outputs"}.
    """
    result = {"n_slots": n_slots, "block_size": block_size, "max_num_seqs": max_num_seqs, "modes": {}}
    runs = {}
    kv_bytes = getattr(executor, "kv_bytes_per_token", None)
    for mode in modes:
        runs[mode] = r = run("paged", requests, executor, clock_factory(), n_slots=n_slots, max_num_seqs=max_num_seqs,
                             block_size=block_size, preemption_mode=mode)
        out = sum(rec.num_blocks_swapped_out for rec in r.records)
        back = sum(rec.num_blocks_swapped_in for rec in r.records)
        result["modes"][mode] = {
            **run_metrics(r, f"paged ({mode})"),
            "recomputed_tokens": recomputed_tokens(r.records, r.requests),
            "num_preempted_requests": sum(req.num_preemptions > 0 for req in r.requests),
            "num_blocks_swapped_out": out, "num_blocks_swapped_in": back,
            "swapped_bytes": None if kv_bytes is None else (out + back) * block_size * kv_bytes,
        }
    result["same_outputs"] = same_outputs(r.requests for r in runs.values())
    return result
