"""Chunked prefill (Sarathi-Serve, Agrawal et al. OSDI'24): notebook 05 and ``benchmarks/chunked_prefill.py``.

A long prompt's prefill, run whole, makes every running decode wait for it (a *generation stall*,
§3.2); cutting prompts into chunks under a per-step token budget and batching the chunks with the
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

from minibatch.experiment import Run, run, same_outputs
from minibatch.request import Request

# Engine options of every run here unless the caller's say otherwise: a KV cache large enough for no preemption
ENGINE_DEFAULTS = {"n_slots": 16384, "max_num_seqs": 32, "block_size": 16}
# The columns of :func:`run_metrics`, in order (``Run.row`` fields and the experiment's own)
FIELDS = ("policy", "clock", "num_requests", "output_throughput_tok_s", "duration_s", "ttft_p50_s", "ttft_p99_s",
          "tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s", "itl_max_s", "num_steps", "num_preemptions",
          "num_chunked_steps")


def run_metrics(result: Run, name: str) -> dict:
    """The numbers every experiment here reports for one finished run: ``result.row`` of FIELDS, "policy" ``name``."""
    return result.row(*FIELDS, policy=name, itl_max_s=max_itl_s(result.requests),
                      num_chunked_steps=sum(any(e.is_chunk for e in r.entries) for r in result.records))


def max_itl_s(requests: list[Request]) -> float:
    """The longest gap between two consecutive tokens of any request (seconds): the worst stall."""
    return max((b - a for r in requests for a, b in zip(r.token_times_s, r.token_times_s[1:])), default=0.0)


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
    """Run ``baselines`` (policy names, no budget) and ``chunked`` at each budget in ``budgets``
    and with the adaptive chunker at each target in ``target_itl_s`` (seconds), on fresh copies of
    ``requests`` with a fresh clock each; kwargs: engine options over ENGINE_DEFAULTS. Rows as
    :func:`run_metrics`, plus "budget" (None for baselines, "adaptive" for the chunker),
    "target_itl_s" and "same_outputs" (every run produced the same tokens)."""
    rows, runs = [], {}
    configs = [(name, name, {}) for name in baselines]
    configs += [(f"chunked-{b}", "chunked", {"max_num_batched_tokens": b}) for b in budgets]
    configs += [(f"adaptive-{t * 1e3:g}ms", "chunked", {"target_itl_s": t}) for t in target_itl_s]
    for name, policy, extra in configs:
        result = run(policy, requests, executor, clock_factory(), **{**ENGINE_DEFAULTS, **extra, **kwargs})
        row = run_metrics(result, name)
        row["budget"] = extra.get("max_num_batched_tokens", "adaptive" if "target_itl_s" in extra else None)
        row["target_itl_s"] = extra.get("target_itl_s")
        rows.append(row)
        runs[name] = result.requests
    same = same_outputs(runs.values())
    for row in rows:
        row["same_outputs"] = same
    return rows


def micro_batching_experiment(requests: list[Request], executor, clock_factory: Callable, **kwargs) -> list[dict]:
    """Prefill-first with one prompt per prefill step vs as many as fit ("prefill
    micro-batching": several prompts' prefills in one packed forward). Rows as :func:`run_metrics`."""
    rows, runs = [], {}
    for name, n in (("one prompt per step", 1), ("batched prefills", None)):
        result = run("prefill_first", requests, executor, clock_factory(), **{**ENGINE_DEFAULTS, **kwargs},
                     max_num_prefills=n)
        rows.append(run_metrics(result, name))
        runs[name] = result.requests
    for row in rows:
        row["same_outputs"] = same_outputs(runs.values())
    return rows
