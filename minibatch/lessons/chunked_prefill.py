"""Measurements and pictures for notebook 05 (chunked prefill) and ``benchmarks/chunked_prefill.py``.

Sarathi-Serve (Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI'24): a long prompt's prefill, run whole, makes every running decode wait
for it (a *generation stall*, §3.3); cutting prompts into chunks under a per-step token budget
and batching the chunks with the decodes (*stall-free batching*, §4.2) bounds the wait by one
budget's step time, at a small cost in throughput (chunks re-read earlier KV; more steps).
The schedulers are ``minibatch/scheduler/chunked.py``; this module runs them and returns plain
dicts (JSON-ready), so the notebook and the benchmark script measure the same way:

* :func:`stall_trace`: a few short chats decoding when one long prompt arrives;
* :func:`itl_points` / :func:`plot_itl_timeline`: every token gap, drawn at the time it ends;
* :func:`plot_budget_split`: per step, decode tokens vs prefill-chunk tokens vs the budget;
* :func:`budget_sweep` / :func:`plot_tradeoff`: prefill-first vs chunked at several budgets
  (and the adaptive chunker): TTFT against TPOT / ITL, and throughput;
* :func:`starvation_experiment`: queue policies under a stream of short requests;
* :func:`micro_batching_experiment`: one prompt per prefill step vs batching them;
* :func:`check_stall_free_plan`: the notebook's exercise check.

Times are seconds (``_s``) on the engine clock (SimClock or WallClock); token counts are tokens.
"""

from __future__ import annotations

from typing import Callable

from minibatch.engine import Engine, StepRecord
from minibatch.metrics import summarize
from minibatch.policies import make_engine
from minibatch.request import Request, SamplingParams
from minibatch.sim.executor import SimExecutor
from minibatch.clock import SimClock

GREEDY = SamplingParams(ignore_eos=True)  # every request runs to exactly max_new_tokens
LABELS = {"prefill_first": "prefill-first (vLLM v0)", "paged": "mixed, whole prefills (Orca-style)",
          "chunked": "chunked prefill (Sarathi-Serve)"}

# Sarathi-Serve's figures (its claim, at its scale): chunking cut TPOT from 4187 ms to
# 204 ms while throughput dropped 3%; batching prefills ("prefill micro-batching") improved
# TTFT p50 3.1x and throughput 1.5x.
SEED_CLAIMS = {"chunked_tpot_ms": (4187, 204), "chunked_throughput_change": -0.03,
               "micro_batching_ttft_p50_x": 3.1, "micro_batching_throughput_x": 1.5}


# ---------------------------------------------------------------------- running one policy
def run_policy(policy: str, requests: list[Request], executor, clock, *, n_slots: int = 16384, max_num_seqs: int = 32,
               block_size: int = 16, **kwargs) -> tuple[list[Request], Engine]:
    """Run fresh copies of ``requests`` to completion under ``policy`` (a make_engine name);
    kwargs go to :func:`~minibatch.policies.make_engine` (max_num_batched_tokens, target_itl_s,
    queue_policy, aging_s, max_num_prefills, ...)."""
    reqs = [r.copy() for r in requests]
    engine = make_engine(policy, executor, clock, n_slots=n_slots, max_num_seqs=max_num_seqs, block_size=block_size, **kwargs)
    engine.generate(reqs)
    return reqs, engine


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


# ---------------------------------------------------------------------- 1. the stall
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


def itl_points(requests: list[Request]) -> list[tuple[float, float, str]]:
    """(time the token came out, gap since the request's previous token, request_id), seconds,
    for every token after each request's first, sorted by time."""
    pts = [(b, b - a, r.request_id) for r in requests for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    return sorted(pts)


def plot_itl_timeline(runs: dict[str, list[Request]], ax=None, mark_s: float | None = None,
                      mark_label: str = "long prompt arrives"):
    """ITL (ms) of every token against the time it came out, one marker style per run; a long
    prompt's prefill shows as a spike shared by every decoding request. Returns the Axes."""
    import matplotlib.pyplot as plt

    from minibatch.viz.results import policy_colors

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5), layout="constrained")
    colors = policy_colors(list(runs))
    for (name, reqs), marker in zip(runs.items(), "os^vD"):
        pts = itl_points(reqs)
        ax.plot([t for t, _, _ in pts], [g * 1e3 for _, g, _ in pts], marker, ms=4, alpha=0.7,
                color=colors[name], label=LABELS.get(name, name))
    if mark_s is not None:
        ax.axvline(mark_s, color="grey", ls=":", lw=1)
        ax.annotate(mark_label, (mark_s, ax.get_ylim()[1]), xytext=(4, -12), textcoords="offset points",
                    fontsize=8, color="grey")
    ax.set_xlabel("time the token came out (s)")
    ax.set_ylabel("ITL (ms)")
    ax.legend(fontsize=8)
    return ax


# ---------------------------------------------------------------------- 2. the budget split
def budget_split(trace: list[StepRecord]) -> dict[str, list[int]]:
    """Per step: decode tokens, tokens of prefills that finish their prompt, and tokens of
    prefill chunks that do not (``StepEntry.is_chunk``)."""
    out = {"decode": [], "prefill": [], "chunk": []}
    for rec in trace:
        out["decode"].append(sum(e.num_new_tokens for e in rec.entries if e.phase == "decode"))
        out["prefill"].append(sum(e.num_new_tokens for e in rec.entries if e.phase == "prefill" and not e.is_chunk))
        out["chunk"].append(sum(e.num_new_tokens for e in rec.entries if e.is_chunk))
    return out


def plot_budget_split(trace: list[StepRecord], budget: int | None = None, ax=None, title: str | None = None):
    """Stacked bars per step: decodes, then prefill chunks, then prefills that finish a prompt,
    with the token budget as a line. Returns the Axes."""
    import matplotlib.pyplot as plt

    from minibatch.viz.plots import HATCH, PALETTE

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3), layout="constrained")
    split = budget_split(trace)
    steps = list(range(len(trace)))
    bottom = [0] * len(trace)
    for kind, label in (("decode", "decode tokens"), ("chunk", "prefill chunk (no token yet)"),
                        ("prefill", "prefill reaching the prompt's end")):
        ax.bar(steps, split[kind], bottom=bottom, width=1.0, color=PALETTE[kind], hatch=HATCH.get(kind),
               edgecolor="white", linewidth=0.3, label=label)
        bottom = [b + v for b, v in zip(bottom, split[kind])]
    if budget is not None:
        ax.axhline(budget, color="black", ls="--", lw=1, label=f"token budget {budget}")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens in the step")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    return ax


# ---------------------------------------------------------------------- 3. the trade-off
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


def plot_tradeoff(rows: list[dict], axes=None, title: str | None = None):
    """Left: TTFT p50 (s) against TPOT p99 (ms), one point per budget, the baselines as stars:
    small budgets buy low TPOT with later first tokens. Right: output throughput per run.
    Returns the two Axes."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    ax, bx = axes
    chunked = [r for r in rows if isinstance(r["budget"], int)]
    ax.plot([r["tpot_p99_s"] * 1e3 for r in chunked], [r["ttft_p50_s"] for r in chunked], "o-",
            color="#CC79A7", label="chunked, fixed budget")
    for r in chunked:
        ax.annotate(str(r["budget"]), (r["tpot_p99_s"] * 1e3, r["ttft_p50_s"]), xytext=(4, 4),
                    textcoords="offset points", fontsize=8)
    for r, marker in zip([r for r in rows if r["budget"] is None], "*P"):
        ax.plot(r["tpot_p99_s"] * 1e3, r["ttft_p50_s"], marker, ms=12, label=LABELS.get(r["policy"], r["policy"]))
    for r in [r for r in rows if r["budget"] == "adaptive"]:
        ax.plot(r["tpot_p99_s"] * 1e3, r["ttft_p50_s"], "D", ms=8, color="#009E73", label=r["policy"])
    ax.set_xlabel("TPOT p99 (ms)")
    ax.set_ylabel("TTFT p50 (s)")
    ax.legend(fontsize=8)
    names = [r["policy"] for r in rows]
    bx.bar(range(len(rows)), [r["output_throughput_tok_s"] for r in rows], color="#56B4E9")
    bx.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=8)
    bx.set_ylabel("output throughput (tok/s)")
    if title:
        ax.figure.suptitle(title, fontsize=10)
    return ax, bx


def print_table(rows: list[dict]) -> None:
    cols = [("output_throughput_tok_s", "out tok/s", "{:.1f}"), ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
            ("ttft_p99_s", "TTFT p99 s", "{:.3f}"), ("tpot_p50_s", "TPOT p50 ms", "{:.1f}"),
            ("tpot_p99_s", "TPOT p99 ms", "{:.1f}"), ("itl_p50_s", "ITL p50 ms", "{:.1f}"),
            ("itl_p99_s", "ITL p99 ms", "{:.1f}"), ("itl_max_s", "ITL max ms", "{:.1f}"), ("num_steps", "steps", "{}")]
    ms = {"tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s", "itl_max_s"}
    print(f"{'run':<22}" + "".join(f"{c[1]:>12}" for c in cols))
    for r in rows:
        cells = [fmt.format(r[k] * (1e3 if k in ms else 1)) if r.get(k) is not None else "-" for k, _, fmt in cols]
        print(f"{r['policy']:<22}" + "".join(f"{c:>12}" for c in cells))


# ---------------------------------------------------------------------- 4. queue policies
def starvation_trace(num_stream: int = 150, gap_s: float = 0.05, low_priority: int = 3,
                     low_prompt_len: int = 4) -> list[Request]:
    """Short priority-0 requests (4 prompt + 4 output tokens) every ``gap_s`` seconds, faster
    than one batch slot serves them, and one request "low" at 0.051 s with priority
    ``low_priority`` and a ``low_prompt_len``-token prompt."""
    reqs = [Request(f"s{i:03d}", [4] * 4, 4, GREEDY, arrival_time_s=gap_s * i) for i in range(num_stream)]
    reqs.append(Request("low", [5] * low_prompt_len, 4, GREEDY, arrival_time_s=0.051, priority=low_priority))
    return sorted(reqs, key=lambda r: r.arrival_time_s)


def starvation_experiment(policy: str = "chunked", aging_s: float = 1.0, max_num_seqs: int = 1, **trace_kwargs) -> list[dict]:
    """Under a stream of short requests (:func:`starvation_trace`, SimExecutor, SimClock), how
    long does request "low" wait (first scheduled - arrival, seconds) with each queue policy?
    It has low priority and, for the SJF row, a long prompt (40 tokens) instead."""
    rows = []
    for name, order, aging, trace in (
            ("fcfs", "fcfs", None, starvation_trace(**trace_kwargs)),
            ("sjf (low has a long prompt)", "sjf", None, starvation_trace(low_priority=0, low_prompt_len=40)),
            ("priority, no aging", "priority", None, starvation_trace(**trace_kwargs)),
            (f"priority, aging {aging_s:g} s/level", "priority", aging_s, starvation_trace(**trace_kwargs))):
        reqs, _ = run_policy(policy, trace, SimExecutor(), SimClock(), max_num_seqs=max_num_seqs, queue_policy=order, aging_s=aging)
        low = next(r for r in reqs if r.request_id == "low")
        rows.append({"queue_policy": name, "low_wait_s": low.first_scheduled_time_s - low.arrival_time_s,
                     "overtaken_by": sum(r.arrival_time_s > low.arrival_time_s
                                         and r.first_scheduled_time_s < low.first_scheduled_time_s for r in reqs),
                     "last_start_s": max(r.first_scheduled_time_s for r in reqs)})
    return rows


# ---------------------------------------------------------------------- 5. prefill micro-batching
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


# ---------------------------------------------------------------------- exercise
def check_stall_free_plan(fn: Callable, budgets=(1, 7, 16, 64), seed: int = 0) -> int:
    """Check ``fn(num_decodes, prefills_left, budget) -> list[int]`` against the chunked
    scheduler: every step of a random run at each budget gives fn the step's decodes and its
    prefills' remaining prompt tokens, and fn must return exactly the tokens the scheduler gave.
    Returns the number of steps checked.

    Raises:
        AssertionError: naming the first step where fn disagrees.
    """
    from minibatch.workload import make_trace

    checked = 0
    for budget in budgets:
        trace = make_trace(12, arrival="poisson", rate_per_s=20, lengths="uniform", prompt_range=(3, 90),
                           output_range=(2, 12), seed=seed + budget)
        reqs = {r.request_id: r for r in trace}
        _, engine = run_policy("chunked", trace, SimExecutor(), SimClock(), max_num_batched_tokens=budget, max_num_seqs=8)
        for rec in engine.trace:
            decodes = [e for e in rec.entries if e.phase == "decode"]
            prefills = [e for e in rec.entries if e.phase == "prefill"]
            left = [reqs[e.request_id].num_prompt_tokens - e.num_computed_tokens for e in prefills]
            want = [1] * len(decodes) + [e.num_new_tokens for e in prefills]
            got = list(fn(len(decodes), left, budget))
            assert got == want, (f"budget {budget}, step {rec.step}: {len(decodes)} decodes, prefills with "
                                 f"{left} tokens left: expected {want}, got {got}")
            checked += 1
    return checked
