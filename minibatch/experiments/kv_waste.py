"""KV waste: Orca's reservation vs paged KV blocks (vLLM, Kwon et al. SOSP'23 §4.1-§4.2) on one trace in
the same KV memory, measured (:func:`reservation_vs_paged`) and predicted from the lengths alone
(:func:`expected_kv_waste`), for notebook 04 and ``benchmarks/paged_kv.py``. Sizes are in KV slots.
"""

from __future__ import annotations

from typing import Callable

from minibatch.experiment import run, same_outputs
from minibatch.experiments.paged_kv import VARIANTS, run_metrics, variant_options
from minibatch.policies import get_policy, make_engine
from minibatch.scheduler import PagedScheduler
from minibatch.request import Request


def cannot_admit(policy: str, requests: list[Request], executor, **options) -> str | None:
    """Why the policy table's ``policy`` with ``options`` could never admit one of ``requests`` (the
    scheduler's ``check_request`` message for the first that does not fit), or None."""
    scheduler = make_engine(policy, executor, **options).scheduler
    for r in requests:
        try:
            scheduler.check_request(r)
        except ValueError as e:
            return str(e)
    return None


def reservation_vs_paged(requests: list[Request], executor, clock_factory: Callable, n_slots: int,
                         max_num_seqs: int = 32, block_size: int = 16, policies=("orca", "paged", "paged_prefix"),
                         orca_max_new_tokens: int | None = None) -> dict:
    """The same trace in the same KV memory (``n_slots`` slots) under each of ``policies`` (VARIANTS names).

    "orca" reserves prompt + the request's own max_new_tokens: with ``ignore_eos`` traces the exact
    output length (vLLM's "Orca (Oracle)", §6.1). A real server reserves its cap on max_new_tokens:
    ``orca_max_new_tokens`` (e.g. 2048) adds "orca_max", which computes the same tokens. A policy that
    could never admit a request in n_slots is skipped: its entry is {"policy", "skipped": reason}.

    clock_factory: a fresh clock per run, e.g. ``SimClock`` or ``WallClock``.
    Returns {"n_slots", "max_num_seqs", "block_size", "orca_max_new_tokens", "policies": {name:
    :func:`run_metrics`}, "same_outputs": every policy that ran produced the same tokens}.
    """
    policies = dict.fromkeys((*policies, "orca_max") if orca_max_new_tokens else policies)  # in order, once each
    result = {"n_slots": n_slots, "max_num_seqs": max_num_seqs, "block_size": block_size,
              "orca_max_new_tokens": orca_max_new_tokens, "policies": {}}
    runs = {}
    for policy in policies:
        row, options = variant_options(policy, n_slots=n_slots, max_num_seqs=max_num_seqs, block_size=block_size,
                                       orca_max_new_tokens=orca_max_new_tokens)
        refused = cannot_admit(row, requests, executor, **options)
        if refused:
            result["policies"][policy] = {"policy": policy, "skipped": refused}
            continue
        runs[policy] = run(row, requests, executor, clock_factory(), **options)
        result["policies"][policy] = run_metrics(runs[policy], policy)
    result["same_outputs"] = same_outputs(r.requests for r in runs.values())
    return result


def expected_kv_waste(requests: list[Request], policy: str, block_size: int = 16,
                      reserve_new_tokens: int | None = None) -> float:
    """kv_waste_fraction predicted from the lengths alone, for a run without preemption.

    A StepRecord is taken after the step's update, so a request with prompt P and O output
    tokens appears in O - 1 records (its last step frees it), holding c = P + k computed
    tokens, k = 0 .. O - 2. It reserves P + O slots in each (Orca; P + max(O, cap) for
    orca_max) or ceil(c / block_size) blocks (paged). Summed over steps, every running request
    counts once per step whoever it shares the batch with, so the fraction does not depend on
    the schedule or on n_slots: only on the reservation rule and the lengths.
    """
    used = reserved = 0
    row, reserves_cap = VARIANTS[policy]
    cap = reserve_new_tokens if reserves_cap else None
    reserves = not issubclass(get_policy(row).scheduler, PagedScheduler)  # Orca's reservation
    for r in requests:
        p, o = r.num_prompt_tokens, r.max_new_tokens
        for c in range(p, p + o - 1):
            used += c
            if reserves:
                reserved += p + max(o, cap or o)
            else:
                reserved += -(-c // block_size) * block_size
    return 1.0 - used / reserved if reserved else 0.0


def waste_sweep(requests: list[Request], executor, clock_factory: Callable, n_slots_list, **kwargs) -> list[dict]:
    """:func:`reservation_vs_paged` at each n_slots (keyword arguments passed on)."""
    return [reservation_vs_paged(requests, executor, clock_factory, n, **kwargs) for n in n_slots_list]
