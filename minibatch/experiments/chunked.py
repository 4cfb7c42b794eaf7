"""Chunked prefill (Sarathi-Serve, Agrawal et al. OSDI'24): notebook 05 and ``benchmarks/chunked_prefill.py``.

A long prompt's prefill, run whole, makes every running decode wait for it (a *generation stall*,
§3.3); cutting prompts into chunks under a per-step token budget and batching the chunks with the
decodes (*stall-free batching*, §4.2) bounds the wait by one budget's step time, at a small cost in
throughput (chunks re-read earlier KV; more steps). The schedulers are ``minibatch/scheduler/chunked.py``;
these functions run them through ``minibatch.experiment.run`` and return plain, JSON-ready rows:

* :func:`stall_trace`: a few short chats decoding when one long prompt arrives;
* :func:`budget_sweep`: prefill-first vs chunked at several budgets (and the adaptive chunker);
* :func:`micro_batching_experiment`: one prompt per prefill step vs batching them.

Queue policies under load are ``minibatch.experiments.queue_policy``. Times are seconds (``_s``) on
the engine clock (SimClock or WallClock); token counts are tokens.
"""

from __future__ import annotations

from typing import Callable

from minibatch.engine import Engine
from minibatch.experiment import run
from minibatch.metrics import summarize
from minibatch.request import Request


def run_policy(policy: str, requests: list[Request], executor, clock, *, n_slots: int = 16384, max_num_seqs: int = 32,
               block_size: int = 16, **kwargs) -> tuple[list[Request], Engine]:
    """Run fresh copies of ``requests`` to completion under ``policy`` (a row of the policy table)
    with :func:`minibatch.experiment.run`; kwargs are EngineConfig fields (max_num_batched_tokens,
    target_itl_s, queue_policy, aging_s, max_num_prefills, ...). Returns (requests, engine).
    Raises what ``run`` raises."""
    result = run(policy, requests, executor, clock, n_slots=n_slots, max_num_seqs=max_num_seqs, block_size=block_size,
                 **kwargs)
    return result.requests, result.engine


def run_metrics(name: str, requests: list[Request], engine: Engine) -> dict:
    """The numbers every experiment here reports for one finished run (a JSON-ready dict)."""
    s = summarize(requests, engine.trace)
    return {
        "policy": name, "clock": engine.clock.kind, "num_requests": len(requests),
        "output_throughput_tok_s": s.output_throughput_tok_s, "duration_s": s.duration_s,
        "ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s,
        "tpot_p50_s": s.tpot_p50_s, "tpot_p99_s": s.tpot_p99_s,
        "itl_p50_s": s.itl_p50_s, "itl_p99_s": s.itl_p99_s, "itl_max_s": max_itl_s(requests),
        "num_steps": s.num_steps, "num_preemptions": s.num_preemptions,
        "num_chunked_steps": sum(any(e.is_chunk for e in r.entries) for r in engine.trace),
    }


def max_itl_s(requests: list[Request]) -> float:
    """The longest gap between two consecutive tokens of any request (seconds): the worst stall."""
    return max((b - a for r in requests for a, b in zip(r.token_times_s, r.token_times_s[1:])), default=0.0)


def same_outputs(runs: dict[str, list[Request]]) -> bool:
    """Did every run produce the same tokens for every request?"""
    outputs = [[r.output_token_ids for r in reqs] for reqs in runs.values()]
    return all(o == outputs[0] for o in outputs)


def stall_trace(tokenizer=None, vocab_size: int = 49152, *, num_short: int = 4, short_prompt_len: int = 24,
                short_output_len: int = 40, long_prompt_len: int = 512, long_output_len: int = 4,
                long_arrival_s: float = 0.5, seed: int = 0) -> list[Request]:
    """``num_short`` short chats arriving 10 ms apart at 0 s, and one long prompt ("long") at
    ``long_arrival_s``, while they are decoding. Prompts are real text with a tokenizer (from
    :func:`minibatch.workload.make_trace`), else random ids. Lengths in tokens.

    Raises:
        ValueError: a length < 1 (from make_trace).
    """
    from minibatch.workload import make_trace

    short = make_trace(num_short, arrival="zero", lengths="fixed", prompt_len=short_prompt_len,
                       output_len=short_output_len, tokenizer=tokenizer, vocab_size=vocab_size, seed=seed)
    long = make_trace(1, arrival="zero", lengths="fixed", prompt_len=long_prompt_len, output_len=long_output_len,
                      tokenizer=tokenizer, vocab_size=vocab_size, seed=seed + 1)[0]
    for i, r in enumerate(short):
        r.arrival_time_s = 0.01 * i
    long.request_id, long.arrival_time_s = "long", long_arrival_s
    return short + [long]


def budget_sweep(requests: list[Request], executor, clock_factory: Callable, budgets, *,
                 baselines=("prefill_first",), target_itl_s=(), **kwargs) -> list[dict]:
    """Run ``baselines`` (make_engine names, no budget) and ``chunked`` at each budget in
    ``budgets`` and with the adaptive chunker at each target in ``target_itl_s`` (seconds), on
    fresh copies of ``requests`` with a fresh clock each. Rows as :func:`run_metrics`, plus
    "budget" (None for baselines, "adaptive" for the chunker), "target_itl_s" and
    "same_outputs" (every run produced the same tokens)."""
    rows, runs = [], {}
    configs = [(name, name, {}) for name in baselines]
    configs += [(f"chunked-{b}", "chunked", {"max_num_batched_tokens": b}) for b in budgets]
    configs += [(f"adaptive-{t * 1e3:g}ms", "chunked", {"target_itl_s": t}) for t in target_itl_s]
    for name, policy, extra in configs:
        reqs, engine = run_policy(policy, requests, executor, clock_factory(), **extra, **kwargs)
        row = run_metrics(name, reqs, engine)
        row["budget"] = extra.get("max_num_batched_tokens", "adaptive" if "target_itl_s" in extra else None)
        row["target_itl_s"] = extra.get("target_itl_s")
        rows.append(row)
        runs[name] = reqs
    same = same_outputs(runs)
    for row in rows:
        row["same_outputs"] = same
    return rows


def micro_batching_experiment(requests: list[Request], executor, clock_factory: Callable, **kwargs) -> list[dict]:
    """Prefill-first with one prompt per prefill step vs as many as fit ("prefill
    micro-batching": several prompts' prefills in one packed forward). Rows as run_metrics."""
    rows, runs = [], {}
    for name, n in (("one prompt per step", 1), ("batched prefills", None)):
        reqs, engine = run_policy("prefill_first", requests, executor, clock_factory(), max_num_prefills=n, **kwargs)
        rows.append(run_metrics(name, reqs, engine))
        runs[name] = reqs
    for row in rows:
        row["same_outputs"] = same_outputs(runs)
    return rows
