"""Queue policies under load: does a low-priority (or long) request starve? Notebook 05.

A stream of short requests, faster than one batch slot serves them, and one request "low" (low
priority; for SJF, a long prompt): first-come first-served serves it in turn, shortest-job-first
and strict priority let the whole stream overtake it, and priority with aging (one level per
``aging_s`` seconds of waiting) bounds its wait. Times are seconds on the simulated clock.
"""

from __future__ import annotations

from minibatch.clock import SimClock
from minibatch.experiment import run
from minibatch.request import Request, SamplingParams
from minibatch.sim.executor import SimExecutor

GREEDY = SamplingParams(ignore_eos=True)  # every request runs to exactly max_new_tokens


def starvation_trace(num_stream: int = 150, gap_s: float = 0.05, low_priority: int = 3,
                     low_prompt_len: int = 4) -> list[Request]:
    """Short priority-0 requests (4 prompt + 4 output tokens) every ``gap_s`` seconds, faster
    than one batch slot serves them, and one request "low" at 0.051 s with priority
    ``low_priority`` and a ``low_prompt_len``-token prompt."""
    reqs = [Request(f"s{i:03d}", [4] * 4, 4, GREEDY, arrival_time_s=gap_s * i) for i in range(num_stream)]
    reqs.append(Request("low", [5] * low_prompt_len, 4, GREEDY, arrival_time_s=0.051, priority=low_priority))
    return sorted(reqs, key=lambda r: r.arrival_time_s)


def starvation_experiment(policy: str = "chunked", aging_s: float = 1.0, max_num_seqs: int = 1,
                          **trace_kwargs) -> list[dict]:
    """Under a stream of short requests (:func:`starvation_trace`, SimExecutor, SimClock), how
    long does request "low" wait (first scheduled - arrival, seconds) with each queue policy?
    It has low priority and, for the SJF row, a long prompt (40 tokens) instead."""
    rows = []
    for name, order, aging, trace in (
            ("fcfs", "fcfs", None, starvation_trace(**trace_kwargs)),
            ("sjf (low has a long prompt)", "sjf", None, starvation_trace(low_priority=0, low_prompt_len=40)),
            ("priority, no aging", "priority", None, starvation_trace(**trace_kwargs)),
            (f"priority, aging {aging_s:g} s/level", "priority", aging_s, starvation_trace(**trace_kwargs))):
        reqs = run(policy, trace, SimExecutor(), SimClock(), max_num_seqs=max_num_seqs, queue_policy=order,
                   aging_s=aging).requests
        low = next(r for r in reqs if r.request_id == "low")
        rows.append({"queue_policy": name, "low_wait_s": low.first_scheduled_time_s - low.arrival_time_s,
                     "overtaken_by": sum(r.arrival_time_s > low.arrival_time_s
                                         and r.first_scheduled_time_s < low.first_scheduled_time_s for r in reqs),
                     "last_start_s": max(r.first_scheduled_time_s for r in reqs)})
    return rows
