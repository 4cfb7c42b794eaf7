"""Notebook 04's variants (Orca's KV reservation, paged KV blocks: vLLM, Kwon et al. SOSP'23) as rows of the
policy table and their options for ``minibatch.experiment.run``, and the numbers every paged-KV experiment reports
for a run (``kv_waste``, ``kv_sharing``, ``preemption``; ``benchmarks/paged_kv.py``).

Units: a *slot* holds one token's K and V in every layer; sizes are in slots unless a name says
blocks or bytes; times are seconds (``_s``) on the engine clock (SimClock or WallClock).
"""

from __future__ import annotations


from minibatch.engine import StepRecord
from minibatch.experiment import Run
from minibatch.policies import get_policy
from minibatch.scheduler import PagedScheduler
from minibatch.request import SamplingParams

GREEDY = SamplingParams(ignore_eos=True)  # every request runs to exactly max_new_tokens
# The lesson's variants: name -> (row of the policy table, whether it reserves the server's cap on new tokens).
# "orca_max" is Orca run by a server without an output-length oracle: prompt + max(max_new_tokens, the cap).
VARIANTS = {"orca": ("orca", False), "orca_max": ("orca", True), "paged": ("paged", False),
            "paged_prefix": ("paged_prefix", False)}
# The columns of :func:`run_metrics`, in order (``Run.row`` fields and the experiment's own)
FIELDS = ("policy", "clock", "n_slots", "num_requests", "kv_waste_fraction", "kv_usage_fraction", "max_num_running",
          "mean_batch_size", "output_throughput_tok_s", "duration_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s",
          "e2e_p99_s", "num_preemptions", "num_steps", "num_prefill_tokens")


def variant_options(variant: str, *, n_slots: int, max_num_seqs: int = 32, block_size: int = 16,
                    orca_max_new_tokens: int | None = None, preemption_mode: str = "recompute") -> tuple[str, dict]:
    """(policy-table row, options for ``run`` / ``make_engine``) of one of VARIANTS in ``n_slots`` KV slots:
    "orca", "orca_max": Orca's per-token slots (block_size 1; "orca_max" reserves prompt +
    max(max_new_tokens, ``orca_max_new_tokens``)); "paged", "paged_prefix": blocks of ``block_size``.

    Raises:
        ValueError: an unknown variant, or "orca_max" without orca_max_new_tokens.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    row, reserves_cap = VARIANTS[variant]
    if reserves_cap and orca_max_new_tokens is None:
        raise ValueError(f"variant {variant!r} needs orca_max_new_tokens (the server's reservation)")
    paged = issubclass(get_policy(row).scheduler, PagedScheduler)  # orca keeps its per-token slots
    reserve = orca_max_new_tokens if reserves_cap else None
    settings = {"max_num_seqs": max_num_seqs, "n_slots": n_slots, "block_size": block_size if paged else None,
                "preemption_mode": preemption_mode, "reserve_new_tokens": reserve}
    return row, {name: value for name, value in settings.items() if name in get_policy(row).options}


def num_prefill_tokens(trace: list[StepRecord]) -> dict[str, int]:
    """request_id -> prompt (and recomputed) tokens computed in prefill steps over the trace."""
    out: dict[str, int] = {}
    for record in trace:
        for e in record.entries:
            if e.phase == "prefill":
                out[e.request_id] = out.get(e.request_id, 0) + e.num_new_tokens
    return out


def run_metrics(result: Run, name: str | None = None) -> dict:
    """The numbers every experiment reports for one finished run: ``result.row`` of FIELDS, "policy"
    ``name`` (default the run's policy).

    kv_waste_fraction: 1 - used / reserved KV slots, summed over steps (metrics.kv_waste_fraction:
    the reservation and the empty tail of each last block). kv_usage_fraction: mean over steps of
    slots holding computed tokens / n_slots (how full of real KV the memory is).
    """
    trace, n_slots = result.records, result.engine.scheduler.kv_capacity_slots(result.engine.executor.max_model_len)
    return result.row(*FIELDS, policy=name or result.policy, n_slots=n_slots,
                      kv_usage_fraction=sum(r.num_kv_slots_used for r in trace) / (len(trace) * n_slots),
                      num_prefill_tokens=sum(num_prefill_tokens(trace).values()))

