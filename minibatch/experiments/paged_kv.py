"""Notebook 04's policies (Orca's KV reservation, paged KV blocks: vLLM, Kwon et al. SOSP'23) as rows of the
policy table run through ``minibatch.experiment.run``, and the numbers every paged-KV experiment reports
for a run (``kv_waste``, ``kv_sharing``, ``preemption``; ``benchmarks/paged_kv.py``).

Units: a *slot* holds one token's K and V in every layer; sizes are in slots unless a name says
blocks or bytes; times are seconds (``_s``) on the engine clock (SimClock or WallClock).
"""

from __future__ import annotations

from typing import Iterable

from minibatch.engine import Engine, StepRecord
from minibatch.experiment import Run, run
from minibatch.policies import get_policy, make_engine
from minibatch.scheduler import PagedScheduler
from minibatch.request import Request, SamplingParams

GREEDY = SamplingParams(ignore_eos=True)  # every request runs to exactly max_new_tokens
# The lesson's policies -> rows of the policy table ("orca_max" is "orca" with reserve_new_tokens set)
POLICY_ROWS = {"orca": "orca", "orca_max": "orca", "paged": "paged", "paged_prefix": "paged_prefix"}
POLICIES = tuple(POLICY_ROWS)


def policy_options(policy: str, *, n_slots: int, max_num_seqs: int = 32, block_size: int = 16,
                   orca_max_new_tokens: int | None = None, preemption_mode: str = "recompute") -> tuple[str, dict]:
    """(policy-table row, options for ``run`` / ``make_engine``) of one of POLICIES in ``n_slots`` KV slots:
    "orca", "orca_max": Orca's per-token slots (block_size 1; "orca_max" reserves prompt +
    max(max_new_tokens, ``orca_max_new_tokens``)); "paged", "paged_prefix": blocks of ``block_size``.

    Raises:
        ValueError: an unknown policy, or "orca_max" without orca_max_new_tokens.
    """
    if policy not in POLICY_ROWS:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    reserve = orca_max_new_tokens if policy == "orca_max" else None
    if policy == "orca_max" and reserve is None:
        raise ValueError("policy 'orca_max' needs orca_max_new_tokens (the server's reservation)")
    row = POLICY_ROWS[policy]
    paged = issubclass(get_policy(row).scheduler, PagedScheduler)  # orca keeps its per-token slots
    return row, {"max_num_seqs": max_num_seqs, "n_slots": n_slots, "block_size": block_size if paged else None,
                 "preemption_mode": preemption_mode, "reserve_new_tokens": reserve}


def policy_engine(policy: str, executor, clock, **kwargs) -> Engine:
    """An Engine for one of POLICIES (keyword arguments: :func:`policy_options`)."""
    row, options = policy_options(policy, **kwargs)
    return make_engine(row, executor, clock, **options)


def run_policy(policy: str, requests: list[Request], executor, clock, **kwargs) -> Run:
    """``run`` fresh copies of ``requests`` under one of POLICIES (keyword arguments: :func:`policy_options`)."""
    row, options = policy_options(policy, **kwargs)
    return run(row, requests, executor, clock, **options)


def num_prefill_tokens(trace: list[StepRecord]) -> dict[str, int]:
    """request_id -> prompt (and recomputed) tokens computed in prefill steps over the trace."""
    out: dict[str, int] = {}
    for record in trace:
        for e in record.entries:
            if e.phase == "prefill":
                out[e.request_id] = out.get(e.request_id, 0) + e.num_new_tokens
    return out


def run_metrics(result: Run, name: str | None = None) -> dict:
    """The numbers every experiment reports for one finished run (a JSON-ready dict); "policy" is
    ``name`` (default the run's policy).

    kv_waste_fraction: 1 - used / reserved KV slots, summed over steps (metrics.kv_waste_fraction:
    the reservation and the empty tail of each last block). kv_usage_fraction: mean over steps of
    slots holding computed tokens / n_slots (how full of real KV the memory is).
    """
    s, trace = result.summary, result.records
    n_slots = result.engine.scheduler.block_manager.num_slots
    return {
        "policy": name or result.policy, "clock": result.engine.clock.kind, "n_slots": n_slots,
        "num_requests": len(result.requests), "kv_waste_fraction": s.kv_waste_fraction,
        "kv_usage_fraction": sum(r.num_kv_slots_used for r in trace) / (len(trace) * n_slots),
        "max_num_running": s.max_num_running, "mean_batch_size": s.mean_batch_size,
        "output_throughput_tok_s": s.output_throughput_tok_s, "duration_s": s.duration_s,
        "ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s, "e2e_p50_s": s.e2e_p50_s, "e2e_p99_s": s.e2e_p99_s,
        "num_preemptions": s.num_preemptions, "num_steps": s.num_steps,
        "num_prefill_tokens": sum(num_prefill_tokens(trace).values()),
    }


def same_outputs(runs: Iterable[list[Request]]) -> bool:
    """Whether every run's requests produced the same tokens (True for no runs)."""
    outputs = [[r.output_token_ids for r in reqs] for reqs in runs]
    return all(o == outputs[0] for o in outputs)
