"""Helpers for notebook 02 (Orca iteration-level batching): the step table, the exercise check and a variant.

Orca (Yu et al., OSDI'22) runs the scheduler again after every *iteration* (step; §3, iteration-level
scheduling), and Algorithm 1 (§4.2) picks each step's batch: every running request, then waiting requests in
arrival order while the batch holds fewer than ``max_num_seqs`` requests and their KV reservations fit.

Everything here reads the schedule trace (the list of :class:`~minibatch.engine.StepRecord`) plus the
requests' arrival times, so it works both live (after each ``engine.step()``) and on a finished run. It assumes
Orca's per-token reservation (``block_size=1``): a request reserves ``max_num_tokens`` = prompt + max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from minibatch.engine import StepEntry, StepRecord
from minibatch.lessons import exercise
from minibatch.request import Request


@dataclass
class ScheduleState:
    """The Orca scheduler's state when it picked one step's batch (Algorithm 1's inputs).

    running: admitted earlier, still unfinished (they all run this step), in admission order.
    waiting: arrived by the step's start, not admitted before it, in arrival order.
    n_rsrv: KV slots reserved by ``running`` before this step's admissions.
    """

    step: int
    running: list[Request]
    waiting: list[Request]
    n_rsrv: int


def schedule_states(trace: list[StepRecord], requests: list[Request]) -> list[ScheduleState]:
    """Rebuild the scheduler's inputs of every step of an Orca ``trace``.

    A request is running at step k if it computed tokens in an earlier step and is in step k's batch (Orca
    runs every running request every step); it is waiting if it arrived by the step's start_s and has not been
    in any earlier batch. Ties in arrival time keep the order of ``requests`` (the order they were added).
    """
    order = {r.request_id: i for i, r in enumerate(requests)}
    by_arrival = sorted(requests, key=lambda r: (r.arrival_time_s, order[r.request_id]))
    by_id = {r.request_id: r for r in requests}
    seen: set[str] = set()
    states = []
    for record in trace:
        running = [by_id[e.request_id] for e in record.entries if e.request_id in seen]
        waiting = [r for r in by_arrival if r.arrival_time_s <= record.start_s and r.request_id not in seen]
        states.append(ScheduleState(record.step, running, waiting, sum(r.max_num_tokens for r in running)))
        seen.update(e.request_id for e in record.entries)
    return states


def entry_label(entry: StepEntry) -> str:
    """``"r0 P70"`` for a prefill of 70 prompt tokens, ``"r1 D"`` for a one-token decode."""
    if entry.phase == "prefill":
        return f"{entry.request_id} P{entry.num_new_tokens}"
    return f"{entry.request_id} {'D' if entry.phase == 'decode' else 'pad'}"


STEP_COLUMNS = (f"{'step':>4} {'time_s':>6}  {'batch (P=prefill, D=decode)':<28} {'n_rsrv/n_slots':>14}  "
                f"{'waiting (why)':<26} finished")


def format_step(record: StepRecord, state: ScheduleState, max_num_seqs: int, n_slots: int) -> str:
    """One row of the step table (see ``STEP_COLUMNS``). n_rsrv is the reservation of this step's batch
    (Algorithm 1's n_rsrv after Select); the waiting column lists requests still waiting after admission and
    why the first one was not admitted: "max_num_seqs" (the batch is full) or "n_rsrv + its reservation > n_slots".
    """
    batch_ids = {e.request_id for e in record.entries}
    n_rsrv = state.n_rsrv + sum(r.max_num_tokens for r in state.waiting if r.request_id in batch_ids)
    left = [r for r in state.waiting if r.request_id not in batch_ids]
    why = ""
    if left:
        head = left[0]
        full = len(record.entries) >= max_num_seqs
        why = " (max_num_seqs)" if full else f" ({n_rsrv}+{head.max_num_tokens}>{n_slots})"
    waiting = " ".join(r.request_id for r in left) + why
    batch = ", ".join(entry_label(e) for e in record.entries)
    return (f"{record.step:>4} {record.start_s:>6.3f}  {batch:<28} {f'{n_rsrv}/{n_slots}':>14}  "
            f"{waiting or '-':<26} {' '.join(record.finished) or '-'}")


def print_requests(requests: list[Request]) -> None:
    """A table of the trace: id, arrival, prompt and output lengths, Orca's reservation, prompt."""
    print(f"{'id':<4} {'arrival_s':>9} {'prompt':>6} {'max_new':>7} {'reserve':>7}  prompt text")
    for r in requests:
        text = (r.prompt_text or "").replace("\n", " ")
        text = text if len(text) <= 44 else text[:41] + "..."
        print(f"{r.request_id:<4} {r.arrival_time_s:>9.2f} {r.num_prompt_tokens:>6} {r.max_new_tokens:>7} "
              f"{r.max_num_tokens:>7}  {text}")


def packed_sizes(trace: list[StepRecord]) -> list[str]:
    """Each step's packed (num_tokens,) forward as "prefill+decode" tokens, e.g. "78+1"."""
    return [f"{r.num_prefill_tokens}+{r.num_decode_tokens}" for r in trace]


SelectFn = Callable[[list[Request], list[Request], int, int, int], tuple[list[Request], int]]


def check_select(select: SelectFn, trace: list[StepRecord], requests: list[Request],
                 max_num_seqs: int, n_slots: int) -> list[tuple[int, list[str], list[str]]]:
    """Replay an Orca ``trace`` through ``select(running, waiting, n_rsrv, max_num_seqs, n_slots)``: at every step
    it gets the scheduler's inputs (:func:`schedule_states`) and must return ``(batch, n_rsrv)``, the batch the
    OrcaScheduler ran, in order, and the slots then reserved. Returns the mismatches as (step, expected ids,
    returned ids); [] means the function reproduces Algorithm 1 on this trace.

    Raises:
        TypeError: ``select`` does not return a (batch, n_rsrv) pair (e.g. an unfinished body).
    """
    mismatches = []
    for state, record in zip(schedule_states(trace, requests), trace):
        expected = [e.request_id for e in record.entries]
        result = select(list(state.running), list(state.waiting), state.n_rsrv, max_num_seqs, n_slots)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"select() must return (batch, n_rsrv), got {result!r}")
        batch, n_rsrv = result
        got = [r.request_id for r in batch]
        expected_rsrv = sum(r.max_num_tokens for r in requests if r.request_id in expected)
        if got != expected or n_rsrv != expected_rsrv:
            mismatches.append((record.step, expected, got))
    return mismatches


def select_skip_ahead(running, waiting, n_rsrv, max_num_seqs, n_slots):
    """Not Algorithm 1: a waiting request that does not fit is skipped and later ones may still join (a fuller
    batch, but a long request can wait forever behind a stream of short ones). Same signature as select()."""
    batch = list(running)
    for req in waiting:
        if len(batch) < max_num_seqs and n_rsrv + req.max_num_tokens <= n_slots:
            n_rsrv, batch = n_rsrv + req.max_num_tokens, batch + [req]
    return batch, n_rsrv


@exercise.check(hint="all running requests run; then admit waiting ones in order, stop at the first that does not fit")
def check_my_select(select: SelectFn, trace: list[StepRecord], requests: list[Request], max_num_seqs: int,
                    n_slots: int) -> str:
    """The exercise: :func:`check_select` on a learner's ``select``; prints one line (see ``exercise.check``)."""
    exercise.require(select([], [], 0, max_num_seqs, n_slots), "select()")
    wrong = check_select(select, trace, requests, max_num_seqs, n_slots)
    if wrong:
        step, expected, got = wrong[0]
        raise AssertionError(f"step {step}: the OrcaScheduler ran {expected}, your select() returned {got}"
                             + (" with another n_rsrv" if got == expected else ""))
    return f"select() reproduces the batch of all {len(trace)} steps"
