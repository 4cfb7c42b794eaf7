"""Notebook 05 (chunked prefill) and ``benchmarks/chunked_prefill.py``: tables, the exercise check.

Sarathi-Serve (Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI'24): a long prompt's prefill, run whole, makes every running decode wait
for it (a *generation stall*, §3.2); cutting prompts into chunks under a per-step token budget
and batching the chunks with the decodes (*stall-free batching*, §4.2) bounds the wait by one
budget's step time, at a small cost in throughput (chunks re-read earlier KV; more steps).
The experiments are ``minibatch.experiments.chunked`` (the stall, the budget sweep, prefill
micro-batching) and ``minibatch.experiments.queue_policy`` (starvation), the figures
``minibatch.viz.chunked``. Here: :func:`print_table`, :func:`print_versus` (ratios said with their
direction, :func:`fold`), :func:`bracketing_budgets`, and the exercise checks
(:func:`check_step_plan`, :func:`check_budget_prediction`).
"""

from __future__ import annotations

from minibatch.clock import SimClock
from minibatch.claims import claim
from minibatch.experiment import run
from minibatch.lessons import exercise
from minibatch.experiments.chunked import budget_sweep
from minibatch.sim.executor import SimExecutor

# Published numbers notebook 05 puts beside ours (minibatch.claims): Sarathi-Serve's own headline, and two
# numbers often quoted about chunked prefill and prefill micro-batching, from an article and a blog post.
CLAIM_IDS = ("sarathi-capacity", "cann-chunked-tpot", "winechord-micro-batching")


def print_published(claim_ids=CLAIM_IDS) -> None:
    """Each published number of ``claim_ids`` with its source, one line each (``minibatch.claims``)."""
    print("published:")
    for claim_id in claim_ids:
        print(" -", claim(claim_id).cite())


def print_table(rows: list[dict]) -> None:
    """Rows of :func:`budget_sweep` (or any ``chunked.run_metrics`` rows) as a table; latencies in s or ms."""
    cols = [("output_throughput_tok_s", "out tok/s", "{:.1f}"), ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
            ("ttft_p99_s", "TTFT p99 s", "{:.3f}"), ("tpot_p50_s", "TPOT p50 ms", "{:.1f}"),
            ("tpot_p99_s", "TPOT p99 ms", "{:.1f}"), ("itl_p50_s", "ITL p50 ms", "{:.1f}"),
            ("itl_p99_s", "ITL p99 ms", "{:.1f}"), ("itl_max_s", "ITL max ms", "{:.1f}"), ("num_steps", "steps", "{}")]
    ms = {"tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s", "itl_max_s"}
    print(f"{'run':<22}" + "".join(f"{c[1]:>12}" for c in cols))
    for r in rows:
        cells = [fmt.format(r[k] * (1e3 if k in ms else 1)) if r.get(k) is not None else "-" for k, _, fmt in cols]
        print(f"{r['policy']:<22}" + "".join(f"{c:>12}" for c in cells))


def fold(before: float, after: float) -> str:
    """How ``after`` compares with ``before`` (both > 0), as a ratio of at least 1 with its direction:
    "2.90x lower", "1.19x higher", or "the same (1.00x)" when it rounds to 1."""
    ratio = before / after if after <= before else after / before
    if round(ratio, 2) == 1:
        return "the same (1.00x)"
    return f"{ratio:.2f}x {'lower' if after < before else 'higher'}"


def print_versus(entries: list[dict], baseline: str = "prefill-first") -> None:
    """One line per run of ``benchmarks/chunked_prefill.py``'s "versus_prefill_first" entries: ITL p99 and
    TPOT p99 against the baseline's, each said as lower or higher, and output throughput as a share of it."""
    for v in entries:
        print(f"  {v['run']:<16} ITL p99 {fold(1.0, 1.0 / v['itl_p99_reduction_x'])}, "
              f"TPOT p99 {fold(1.0, 1.0 / v['tpot_p99_reduction_x'])}, "
              f"throughput {v['throughput_ratio']:.0%} of {baseline}")


def bracketing_budgets(rows: list[dict], run: str, key: str = "itl_p99_s") -> str:
    """Where run ``run`` of a :func:`budget_sweep` lands among the fixed budgets on ``key`` (a latency, s):
    "adaptive-200ms: ITL p99 203.8 ms, between chunked-64 (147.6 ms) and chunked-128 (244.2 ms)", or below the
    smallest / above the largest. Raises ValueError when ``run`` is not a row or no row has a fixed budget."""
    mine = next((r for r in rows if r["policy"] == run), None)
    fixed = sorted((r for r in rows if isinstance(r["budget"], int)), key=lambda r: r[key])
    if mine is None or not fixed:
        raise ValueError(f"run must be one of {[r['policy'] for r in rows]} and rows need a fixed budget, got {run!r}")
    def at(r):
        return f"{r['policy']} ({r[key] * 1e3:.1f} ms)"

    label = key.removesuffix("_s").replace("_", " ").upper().replace(" P", " p")  # "itl_p99_s" -> "ITL p99"
    below = [r for r in fixed if r[key] <= mine[key]]
    above = [r for r in fixed if r[key] > mine[key]]
    where = (f"between {at(below[-1])} and {at(above[0])}" if below and above else
             f"above every fixed budget (highest: {at(below[-1])})" if below else
             f"below every fixed budget (lowest: {at(above[0])})")
    return f"{run}: {label} {mine[key] * 1e3:.1f} ms, {where}"


COMPETE = (("d", 4, 10), ("A", 17, 6), ("B", 20, 6))  # (request_id, prompt tokens, output tokens), all at 0 s


def compete_run(budget: int = 16, requests=COMPETE) -> list:
    """The chunked scheduler (token budget ``budget``) on ``requests`` (id, prompt, output), all arriving at 0 s
    in that order; SimExecutor, SimClock. Returns the trace."""
    from minibatch.request import Request, SamplingParams

    reqs = [Request(rid, [5] * p, n, SamplingParams(ignore_eos=True)) for rid, p, n in requests]
    return run("chunked", reqs, SimExecutor(), SimClock(), max_num_batched_tokens=budget, max_num_seqs=8).records


@exercise.check(hint="decodes first, one token each; then the prefill already under way, then new prompts, each "
                     "cut to the budget left; a prompt whose last chunk ran has sampled a token: it decodes next")
def check_step_plan(prediction: dict, trace: list, steps=(1, 2), show_answer: bool = False) -> str:
    """The exercise: ``prediction`` = {"step S": {request_id: num_new_tokens}} for each S of ``steps``, every request
    of the trace included (0 for one not in the step), against the chunked run's ``trace``. A miss names the first
    wrong request of the first wrong step, "too low" or "too high"."""
    ids = list(dict.fromkeys(e.request_id for r in trace for e in r.entries))
    measured = {f"step {s}": {rid: next((e.num_new_tokens for e in trace[s].entries if e.request_id == rid), 0)
                              for rid in ids} for s in steps}
    exercise.expect(prediction, measured, show_answer=show_answer)
    return "; ".join(f"{k}: " + ", ".join(f"{rid} {n}" for rid, n in v.items()) for k, v in measured.items())


@exercise.check(hint="a step's time grows by about the same amount per prefill token; section 3's table gives "
                     "two budgets' ITL p99")
def check_budget_prediction(prediction, requests: list, budgets=(128, 160, 192, 224, 256),
                            target_itl_s: float = 0.3, show_answer: bool = False) -> str:
    """Check a predicted budget: of ``budgets``, the one whose chunked run over ``requests``
    (SimExecutor, SimClock) has the highest output throughput among those with ITL p99 at most
    ``target_itl_s`` seconds. Prints one line (``exercise.check``); returns whether it was right.

    Raises (reported as "not yet"):
        AssertionError: a budget not in ``budgets``; "too high" (over the target) or "too low" (less throughput);
        the answer itself only with ``show_answer``.
    """
    prediction = exercise.require(prediction, "my_prediction")
    assert prediction in budgets, f"choose one of the budgets {list(budgets)}, not {prediction!r}"
    rows = {r["budget"]: r for r in budget_sweep(requests, SimExecutor(), SimClock, budgets, baselines=())}
    ok = [b for b in budgets if rows[b]["itl_p99_s"] <= target_itl_s]
    best = max(ok, key=lambda b: rows[b]["output_throughput_tok_s"]) if ok else None
    mine, ms = rows[prediction], target_itl_s * 1e3
    words = (f"too low: budget {prediction} meets the target, but a larger one does too, with more throughput",
             f"too high: budget {prediction} has ITL p99 {mine['itl_p99_s'] * 1e3:.0f} ms, over the {ms:.0f} ms target")
    exercise.expect(prediction, best, show_answer=show_answer, words=words)
    over = [b for b in budgets if b not in ok]
    after = f"; budget {over[0]} is over it ({rows[over[0]]['itl_p99_s'] * 1e3:.0f} ms)" if over else ""
    return (f"budget {best}: ITL p99 {mine['itl_p99_s'] * 1e3:.0f} ms (target {ms:.0f} ms), "
            f"{mine['output_throughput_tok_s']:.1f} output tok/s{after}")
