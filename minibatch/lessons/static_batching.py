"""Helpers for notebook 01_static_batching (too long for a notebook cell) and its exercise checks.

Static batching's three wastes (Orca, Yu et al., OSDI'22, §2.2 and §3):

* early-finished: a request that finishes early keeps its row until the longest one is done;
* late-joining: a request that arrives while a batch runs waits for the whole batch;
* padding: short prompts are padded to the longest prompt of the batch.

Everything here drives the one :class:`~minibatch.engine.Engine` through
:func:`~minibatch.experiment.run` (``make_engine`` to time one step); nothing re-implements a scheduler.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from minibatch.engine import StepRecord
from minibatch.records import first_steps
from minibatch.lessons import exercise
from minibatch.models import set_attention
from minibatch.records import measured_decode_utilization, utilization_formula
from minibatch.experiment import run
from minibatch.policies import make_engine
from minibatch.request import Request, SamplingParams
from minibatch.roofline import torch_threads
from minibatch.runner.prepack import engine_linears
from minibatch.sim.executor import SimExecutor
from minibatch.clock import WallClock
from minibatch.prompts import chat_prompt_ids
from minibatch.workload import sharegpt_lengths


def chat_requests(tokenizer, prompts: list[str], output_lens: list[int],
                  arrival_times_s: list[float] | None = None, first_index: int = 0) -> list[Request]:
    """Greedy requests "req-0", "req-1", ... on real chat prompts, each producing exactly
    ``output_lens[i]`` tokens (ignore_eos, as vLLM's benchmarks do). Arrivals default to 0 s."""
    if len(prompts) != len(output_lens):
        raise ValueError(f"prompts ({len(prompts)}) and output_lens ({len(output_lens)}) must have the same length")
    arrivals = arrival_times_s if arrival_times_s is not None else [0.0] * len(prompts)
    return [Request(f"req-{first_index + i}", chat_prompt_ids(tokenizer, text), max_new_tokens=n,
                    sampling=SamplingParams(ignore_eos=True), arrival_time_s=t, prompt_text=text)
            for i, (text, n, t) in enumerate(zip(prompts, output_lens, arrivals))]


def sim_requests(output_lens: list[int], prompt_len: int = 16, prefix: str = "req") -> list[Request]:
    """Requests for the SimExecutor (no model): all arrive at 0 s, fixed prompt length."""
    return [Request(f"{prefix}-{i}", [5] * prompt_len, max_new_tokens=n, sampling=SamplingParams(ignore_eos=True))
            for i, n in enumerate(output_lens)]


def utilization_table(num_batches: int, batch_size: int, max_output_len: int = 32, seed: int = 0,
                      lengths: str = "uniform") -> list[dict]:
    """Formula vs measured decode utilization of random static batches, each run alone (SimExecutor, no model).

    lengths: "uniform" (1..max_output_len) or "sharegpt" (real chat answers' token lengths, resampled;
    max_output_len ignored); draws from ``numpy.random.default_rng(seed)``. One dict per batch:
    output_lens, formula, measured."""
    if lengths not in ("uniform", "sharegpt"):
        raise ValueError(f"lengths must be 'uniform' or 'sharegpt', got {lengths!r}")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_batches):
        lens = (rng.integers(1, max_output_len + 1, size=batch_size).tolist() if lengths == "uniform"
                else [o for _, o in sharegpt_lengths(batch_size, rng)])
        result = run("static", sim_requests(lens), SimExecutor(), batch_size=batch_size)
        rows.append({"output_lens": lens, "formula": utilization_formula(lens),
                     "measured": measured_decode_utilization(result.records)})
    return rows


def sharegpt_utilization(batch_sizes: list[int], num_batches: int = 1000, seed: int = 0) -> dict[int, float]:
    """Mean avg_len / max_len (``utilization_formula``) of ``num_batches`` random static batches per batch
    size, output lengths resampled from real ShareGPT answers (formula only: no engine run, so it is fast)."""
    rng = np.random.default_rng(seed)
    out = {}
    for b in batch_sizes:
        lens = np.array([o for _, o in sharegpt_lengths(b * num_batches, rng)]).reshape(num_batches, b)
        out[b] = float(np.mean(lens.mean(axis=1) / lens.max(axis=1)))  # (num_batches,) utilizations
    return out


def print_utilization_table(rows: list[dict]) -> None:
    """Print :func:`utilization_table` rows: lengths, formula avg/max, measured, equal?"""
    print(f"{'output_lens':<34}{'avg/max':>9}{'measured':>10}  equal")
    for row in rows:
        lens = " ".join(f"{n:2d}" for n in row["output_lens"])
        equal = abs(row["formula"] - row["measured"]) < 1e-12
        print(f"{lens:<34}{row['formula']:>9.3f}{row['measured']:>10.3f}  {equal}")


def print_steps(trace: list[StepRecord]) -> None:
    """One line per step: index, sim time span, and each batch row's phase (P/D/pad) + new tokens."""
    print(f"{'step':>4} {'start_s':>8} {'end_s':>7}  rows (row: request phase num_new_tokens)")
    for r in trace:
        rows = "  ".join(f"{e.row}:{e.request_id} {e.phase} {e.num_new_tokens}"
                         for e in sorted(r.entries, key=lambda e: e.row))
        print(f"{r.step:>4} {r.start_s:>8.3f} {r.end_s:>7.3f}  {rows}")


@exercise.check(hint="a batch runs until its longest member is done; print_steps(trace) shows every row")
def check_padding_rows(answer: int, trace: list[StepRecord], show_answer: bool = False) -> str:
    """Exercise: ``answer``, the padding decode rows (rows of already finished requests), against a static run
    (a miss says "too low" or "too high"; ``show_answer`` also prints the engine's count)."""
    measured = exercise.expect(answer, sum(e.phase == "padding" for r in trace for e in r.entries), "my_answer",
                               show_answer=show_answer)
    return f"{measured} padding decode rows, as in the engine's trace"


@exercise.check(hint="the prefill step samples a request's first token; Orca refills a freed row in the next step")
def check_start_steps(prediction: dict, traces: dict[str, list[StepRecord]], request_id: str,
                      show_answer: bool = False) -> str:
    """Exercise: ``prediction`` = {policy: the first step that runs ``request_id``}, against each policy's trace
    (a miss names the first wrong policy, "too early" or "too late"; ``show_answer`` also prints the steps)."""
    measured = {policy: first_steps(trace)[request_id] for policy, trace in traces.items()}
    exercise.expect(prediction, measured, show_answer=show_answer, words=("too early", "too late"))
    return ", ".join(f"{policy} runs {request_id} first at step {step}" for policy, step in measured.items())


@torch.inference_mode()
def time_prefill(model, runner, prompts: list[list[int]], repeats: int = 3,
                 num_threads: int | None = 1) -> dict[str, float]:
    """Best-of-``repeats`` wall time (s) of one prefill of ``prompts`` three ways:

    * "padded (B, T)": a static engine's first step (prompts left-padded to the longest);
    * "separate": one unpadded forward per prompt, one after the other (with the engine's linear kernels, as
      the two engine steps have them, so the three differ only in how the prompts are batched);
    * "packed (1, num_tokens)": an Orca engine's first step (selective batching, no padding).
    num_threads: torch CPU threads while timing (restored afterwards; None = leave as is). The default, 1,
    keeps the comparison steady on a shared CPU: when other processes hold the cores, multi-threaded
    kernels stall on each other and times swing by 10x or more."""
    def engine_step(policy: str) -> float:
        reqs = [Request(f"p{i}", ids, 1, SamplingParams(ignore_eos=True)) for i, ids in enumerate(prompts)]
        n_slots = max(1024, sum(r.max_num_tokens for r in reqs))  # a small KV cache, reused across calls
        engine = make_engine(policy, runner, WallClock(),
                             config={"batch_size": len(reqs), "max_num_seqs": len(reqs), "n_slots": n_slots})
        for r in reqs:
            engine.add_request(r)
        return engine.step().duration_s

    def separate() -> float:
        set_attention(model, "sdpa")
        t0 = time.perf_counter()
        with engine_linears():
            for ids in prompts:
                model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0

    timers = {"padded (B, T)": lambda: engine_step("static"), "separate": separate,
              "packed (1, num_tokens)": lambda: engine_step("orca")}
    with torch_threads(num_threads):
        return {name: min(fn() for _ in range(repeats)) for name, fn in timers.items()}


def mark_arrival(fig, time_s: float, label: str) -> None:
    """A dotted vertical line at ``time_s`` on every axes of a :func:`~minibatch.viz.compare_gantt` figure (x="time"),
    with ``label`` (e.g. "req-4 arrives") written at the top of the first chart."""
    for ax in fig.axes:
        ax.axvline(time_s, color="black", ls=":", lw=1.2, zorder=5)
    top = fig.axes[0]
    top.annotate(label, (time_s, 1.0), xycoords=("data", "axes fraction"), xytext=(3, 2), textcoords="offset points",
                 fontsize=8, va="bottom", annotation_clip=False)
