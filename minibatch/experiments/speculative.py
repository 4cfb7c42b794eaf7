"""Speculative decoding k sweeps on real models: notebook 06 and ``benchmarks/spec_decode.py``.

A cheap draft proposes k tokens, the target checks all of them in ONE forward (k+1 positions), and
the rejection sampler keeps a prefix (Leviathan et al. 2023, Chen et al. 2023). The machinery is
``minibatch/spec``; one run is ``run("spec", requests, runner, clock, draft_runner=...,
num_speculative_tokens=k)`` (``minibatch.experiment``). Here :func:`k_sweep`: no speculation, the
draft at each k, AdaptiveK and n-gram lookup on the same requests, as plain, JSON-ready rows.

When it pays (the speedup model, batch size) is ``minibatch.experiments.spec_speedup``.

Times are seconds (``_s``) on the engine clock (SimClock or WallClock).
"""

from __future__ import annotations

from typing import Callable

from minibatch.experiment import run
from minibatch.request import Request
from minibatch.spec import AdaptiveK

BLOCK_SIZE = 16  # KV block size of every run here, tokens
N_SLOTS = 512 * BLOCK_SIZE  # KV cache of a k-sweep run, token slots

# Input-grounded prompts (our own words): the answer copies spans of the prompt, where n-gram
# prompt lookup shines.
GROUNDED_PROMPTS = (
    "Rewrite the following paragraph, replacing every 'car' with 'bicycle' and changing nothing else:\n\n"
    "The car was parked outside the bakery. Every morning the owner of the car bought two loaves of bread, "
    "put them on the back seat of the car, and drove to the station. People in the town said the car was "
    "older than the station itself.",
    "Fix the bug in this function and return the whole corrected function:\n\n"
    "def average(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n"
    "    return total / len(numbers) if numbers else total / 0\n",
    "Extract every name and age from this text as a list of 'name: age' lines:\n\n"
    "Anna is 34 and lives with Ben, who is 36. Their neighbours are Carla, 71, and her grandson David, 12. "
    "Ben's sister Emma is 29.",
)


# A k-sweep row: some of Run.row's fields and the sweep's own columns, then with speculation
# "spec" (SpecDecodingStats: vLLM's acceptance rate = accepted / drafted, mean acceptance length, ...)
# and "k" (the speculator, e.g. AdaptiveK with its estimate of Leviathan's per-token alpha).
FIELDS = ("run", "clock", "max_num_seqs", "num_requests", "num_output_tokens", "output_throughput_tok_s",
          "decode_throughput_tok_s", "tpot_p50_s", "ttft_p50_s", "duration_s", "num_steps")


def decode_throughput_tok_s(requests: list[Request]) -> float | None:
    """Output tokens after each request's first, per second of decoding (first to last token),
    over finished ``requests``; None when no request decoded."""
    decode_s = sum(r.token_times_s[-1] - r.token_times_s[0] for r in requests)
    return sum(r.num_output_tokens - 1 for r in requests) / decode_s if decode_s else None


def k_sweep(requests: list[Request], target_runner, draft_runner, clock_factory: Callable, ks=(1, 2, 3, 4, 6),
            max_num_seqs: int = 1, adaptive_max_k: int | None = 6, ngram: bool = True,
            verify_cost_ratio: float = 1.0) -> tuple[list[dict], bool]:
    """No speculation ("paged"), the draft at each fixed k in ``ks`` ("spec"), AdaptiveK (up to
    adaptive_max_k, told that a verify forward costs ``verify_cost_ratio`` decodes; None: skipped)
    and n-gram lookup at k = 4 ("spec_ngram"), on fresh copies of the same requests, each on a fresh
    ``clock_factory()`` with max_num_seqs and N_SLOTS KV slots in blocks of BLOCK_SIZE tokens.

    Returns (rows, every run produced the same tokens). A row has FIELDS, then "spec" and "k" for
    speculative runs; rows after the first also "speedup" and "decode_speedup" over no speculation.
    Raises what ``run`` raises.
    """
    arms = [("no speculation", "paged", {})] + [(f"draft k={k}", "spec", {"num_speculative_tokens": k}) for k in ks]
    if adaptive_max_k:
        arms.append((f"draft adaptive k<={adaptive_max_k}", "spec",
                     {"speculator": AdaptiveK(max_k=adaptive_max_k, verify_cost_ratio=verify_cost_ratio)}))
    if ngram:
        arms.append(("n-gram k=4", "spec_ngram", {"num_speculative_tokens": 4}))
    rows, outputs = [], []
    for name, policy, options in arms:
        result = run(policy, requests, target_runner, clock_factory(), draft_runner=draft_runner,
                     max_num_seqs=max_num_seqs, n_slots=N_SLOTS, block_size=BLOCK_SIZE, **options)
        executor = result.engine.executor
        speculator = getattr(executor, "speculator", None)
        spec = {} if speculator is None else {"spec": executor.stats.as_dict(), "k": repr(speculator)}
        row = result.row(*FIELDS, *spec, run=name, max_num_seqs=max_num_seqs, **spec,
                         num_output_tokens=sum(r.num_output_tokens for r in result.requests),
                         decode_throughput_tok_s=decode_throughput_tok_s(result.requests))
        if rows:
            row["speedup"] = row["output_throughput_tok_s"] / rows[0]["output_throughput_tok_s"]
            row["decode_speedup"] = row["decode_throughput_tok_s"] / rows[0]["decode_throughput_tok_s"]
        rows.append(row)
        outputs.append([r.output_token_ids for r in result.requests])
    return rows, all(o == outputs[0] for o in outputs)
