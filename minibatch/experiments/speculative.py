"""Speculative decoding runs, k sweeps on real models: notebook 06 and ``benchmarks/spec_decode.py``.

A cheap draft proposes k tokens, the target checks all of them in ONE forward (k+1 positions), and
the rejection sampler keeps a prefix (Leviathan et al. 2023, Chen et al. 2023). The machinery is
``minibatch/spec``; this module runs it and returns plain, JSON-ready rows:

* :func:`run_spec_policy` / :func:`run_spec`: one run (a policy row, or proposer and speculator
  objects) and its metrics row;
* :func:`k_sweep`: no speculation, the draft at each k, AdaptiveK and n-gram lookup, same requests.

When it pays (the speedup model, batch size) is ``minibatch.experiments.spec_speedup``.

Times are seconds (``_s``) on the engine clock (SimClock or WallClock).
"""

from __future__ import annotations

from typing import Callable

from minibatch.engine import Engine
from minibatch.experiment import run
from minibatch.metrics import summarize
from minibatch.request import Request
from minibatch.scheduler import PagedScheduler
from minibatch.spec import AdaptiveK, DraftModelProposer, SpeculativeRunner

BLOCK_SIZE = 16  # KV block size of every run here, tokens

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


def spec_row(name: str, requests: list[Request], engine: Engine, max_num_seqs: int) -> dict:
    """The metrics row of a finished run: output throughput, TPOT, decode throughput (output tokens
    after the first per second of decoding) and, when speculating, the SpecDecodingStats ("spec")
    and the speculator ("k")."""
    s = summarize(requests, engine.trace)
    decode_s = sum(r.token_times_s[-1] - r.token_times_s[0] for r in requests)
    row = {"run": name, "clock": engine.clock.kind, "max_num_seqs": max_num_seqs, "num_requests": len(requests),
           "num_output_tokens": sum(r.num_output_tokens for r in requests),
           "output_throughput_tok_s": s.output_throughput_tok_s,
           "decode_throughput_tok_s": sum(r.num_output_tokens - 1 for r in requests) / decode_s if decode_s else None,
           "tpot_p50_s": s.tpot_p50_s, "ttft_p50_s": s.ttft_p50_s, "duration_s": s.duration_s, "num_steps": s.num_steps}
    speculator = getattr(engine.executor, "speculator", None)
    if speculator is not None:
        row["spec"] = engine.executor.stats.as_dict()
        row["k"] = repr(speculator)
    return row


def run_spec_policy(name: str, policy: str, requests: list[Request], target_runner, clock, *, max_num_seqs: int = 1,
                    num_blocks: int = 512, draft_runner=None, **options) -> tuple[dict, list[Request], Engine]:
    """Run fresh copies of ``requests`` under ``policy`` ("paged", "spec", "spec_ngram", ...) with
    ``num_blocks`` KV blocks of BLOCK_SIZE tokens; options: EngineConfig fields (num_speculative_tokens,
    adaptive_k). Returns (:func:`spec_row`, the requests, the engine). Raises what ``run`` raises."""
    result = run(policy, requests, target_runner, clock, draft_runner=draft_runner, max_num_seqs=max_num_seqs,
                 n_slots=num_blocks * BLOCK_SIZE, block_size=BLOCK_SIZE, **options)
    return spec_row(name, result.requests, result.engine, max_num_seqs), result.requests, result.engine


def make_spec_engine(target_runner, proposer=None, speculator=None, clock=None, *, max_num_seqs: int = 1,
                     num_blocks: int = 512, block_size: int = BLOCK_SIZE) -> Engine:
    """A paged engine on ``target_runner``; with a proposer, speculative: a SpeculativeRunner over
    these proposer and speculator objects, with a lookahead KV slot per draft token when the proposer
    writes KV (a draft model). For objects the policy table cannot build (an AdaptiveK told its
    verify cost, a proposer of one's own); :func:`run_spec_policy` runs the built-in ones."""
    lookahead = 0
    if proposer is None:
        executor = target_runner
    else:
        executor = SpeculativeRunner(target_runner, proposer, speculator)
        lookahead = executor.speculator.max_k if proposer.writes_kv else 0  # the draft's KV slots
    sched = PagedScheduler(max_num_seqs=max_num_seqs, num_blocks=num_blocks, block_size=block_size,
                           num_lookahead_tokens=lookahead)
    executor.allocate_kv_cache(num_blocks, block_size)
    return Engine(sched, executor, clock)


def run_spec(name: str, requests: list[Request], target_runner, clock, proposer=None, speculator=None,
             max_num_seqs: int = 1, num_blocks: int = 512) -> tuple[dict, list[Request], Engine]:
    """Run fresh copies of ``requests`` on :func:`make_spec_engine` (no proposer: no speculation);
    returns (:func:`spec_row`, the requests, the engine)."""
    reqs = [r.copy() for r in requests]
    engine = make_spec_engine(target_runner, proposer, speculator, clock, max_num_seqs=max_num_seqs,
                              num_blocks=num_blocks)
    engine.generate(reqs)
    return spec_row(name, reqs, engine, max_num_seqs), reqs, engine


def k_sweep(requests: list[Request], target_runner, draft_runner, clock_factory: Callable, ks=(1, 2, 3, 4, 6),
            max_num_seqs: int = 1, adaptive_max_k: int | None = 6, ngram: bool = True,
            verify_cost_ratio: float = 1.0) -> tuple[list[dict], bool]:
    """No speculation, the draft at each fixed k, AdaptiveK (up to adaptive_max_k, told that a
    verify forward costs ``verify_cost_ratio`` decodes) and n-gram lookup, on the same requests with
    a fresh ``clock_factory()`` each. Returns (rows, every run produced the same tokens); rows after
    the first have "speedup" and "decode_speedup" over no speculation."""
    runs = [("no speculation", "paged", {})] + [(f"draft k={k}", "spec", {"num_speculative_tokens": k}) for k in ks]
    if adaptive_max_k:
        runs.append((f"draft adaptive k<={adaptive_max_k}", None, {}))
    if ngram:
        runs.append(("n-gram k=4", "spec_ngram", {"num_speculative_tokens": 4}))
    rows, outputs = [], []
    for name, policy, options in runs:
        if policy is None:  # AdaptiveK with its verify cost: not a policy-table option
            row, reqs, _ = run_spec(name, requests, target_runner, clock_factory(), DraftModelProposer(draft_runner),
                                    AdaptiveK(max_k=adaptive_max_k, verify_cost_ratio=verify_cost_ratio),
                                    max_num_seqs=max_num_seqs)
        else:
            row, reqs, _ = run_spec_policy(name, policy, requests, target_runner, clock_factory(),
                                           max_num_seqs=max_num_seqs, draft_runner=draft_runner, **options)
        if rows:
            row["speedup"] = row["output_throughput_tok_s"] / rows[0]["output_throughput_tok_s"]
            row["decode_speedup"] = row["decode_throughput_tok_s"] / rows[0]["decode_throughput_tok_s"]
        rows.append(row)
        outputs.append([r.output_token_ids for r in reqs])
    return rows, all(o == outputs[0] for o in outputs)
