"""Helpers for notebook 02 (Orca iteration-level batching): the step table, the KV strip, the exercise checks.

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

from minibatch.engine import StepRecord
from minibatch.records import StepEntry
from minibatch.records import first_steps
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

# Head-of-line blocking (the prediction): (request_id, prompt tokens, output tokens), all arriving at 0 s in this order.
HOL_REQUESTS = (("a", 10, 30), ("b", 10, 10), ("L", 30, 20), ("s", 10, 5))
HOL_MAX_NUM_SEQS, HOL_N_SLOTS = 4, 100


def sim_requests(spec, arrivals=None) -> list[Request]:
    """Requests for the SimExecutor from (request_id, prompt tokens, output tokens) triples (ignore_eos)."""
    from minibatch.request import SamplingParams

    arrivals = arrivals or [0.0] * len(spec)
    return [Request(rid, [5] * p, n, SamplingParams(ignore_eos=True), arrival_time_s=t)
            for (rid, p, n), t in zip(spec, arrivals)]


def hol_run() -> list[StepRecord]:
    """The OrcaScheduler (Algorithm 1) on :data:`HOL_REQUESTS` (SimExecutor, SimClock). Returns the trace."""
    from minibatch.clock import SimClock
    from minibatch.experiment import run
    from minibatch.sim.executor import SimExecutor

    return run("orca", sim_requests(HOL_REQUESTS), SimExecutor(), SimClock(), max_num_seqs=HOL_MAX_NUM_SEQS,
               n_slots=HOL_N_SLOTS).records


@exercise.check(hint="a request is admitted only when n_rsrv + its reservation <= n_slots, and Select stops at the "
                     "first waiting request that does not fit; a request of n output tokens runs n steps")
def check_hol_prediction(prediction: dict, trace: list[StepRecord], show_answer: bool = False) -> str:
    """The exercise: ``prediction`` = {"L": step, "s": step}, the first step L and s run in ``trace`` (a miss says
    "too early" or "too late" for the first wrong one)."""
    measured = {rid: first_steps(trace)[rid] for rid in ("L", "s")}
    exercise.expect(prediction, measured, show_answer=show_answer, words=("too early", "too late"))
    return f"L first runs at step {measured['L']}, s at step {measured['s']}, as in the OrcaScheduler's trace"


def replay(select: SelectFn, requests: list[Request], max_num_seqs: int, n_slots: int,
           num_steps: int) -> dict[str, int]:
    """Run ``select`` as a step loop (no model): at each step it gets the running requests and those waiting (arrived:
    ``arrival_time_s`` read as a step number), every request in the batch computes one token, and one that has
    all its max_new_tokens releases its reservation. Returns the first step of each request that ran."""
    left = {r.request_id: r.max_new_tokens for r in requests}
    running, n_rsrv, started = [], 0, {}
    for step in range(num_steps):
        waiting = [r for r in requests if r.arrival_time_s <= step and r.request_id not in started]
        batch, n_rsrv = select(list(running), waiting, n_rsrv, max_num_seqs, n_slots)
        running = []
        for r in batch:
            started.setdefault(r.request_id, step)
            left[r.request_id] -= 1
            if left[r.request_id]:
                running.append(r)
            else:
                n_rsrv -= r.max_num_tokens
    return started


def stream(num_short: int = 40, gap: int = 5) -> list[Request]:
    """A long request "L" (30 + 20 tokens) arriving at step 12 amid a stream of short ones (10 + 20 tokens), one
    every ``gap`` steps from step 0: for :func:`replay` in 100 slots."""
    spec = [("L", 30, 20)] + [(f"q{i}", 10, 20) for i in range(num_short)]
    return sim_requests(spec, [12.0] + [float(gap * i) for i in range(num_short)])


def _algorithm1(running, waiting, n_rsrv, max_num_seqs, n_slots):
    batch = list(running)
    for req in waiting:
        if len(batch) == max_num_seqs or n_rsrv + req.max_num_tokens > n_slots:
            break
        n_rsrv, batch = n_rsrv + req.max_num_tokens, batch + [req]
    return batch, n_rsrv


def skip_ahead_states(seed: int = 0, num: int = 300):
    """Random scheduler inputs (running, waiting, n_rsrv, max_num_seqs, n_slots) for the skip-ahead check."""
    import random

    rng = random.Random(seed)
    for i in range(num):
        reqs = sim_requests([(f"r{j}", rng.randint(1, 40), rng.randint(1, 40)) for j in range(rng.randint(1, 8))])
        k = rng.randint(0, min(3, len(reqs)))
        n_rsrv = sum(r.max_num_tokens for r in reqs[:k])
        yield reqs[:k], reqs[k:], n_rsrv, rng.randint(max(1, k), 6), n_rsrv + rng.randint(0, 120)


def skip_ahead_problem(select: SelectFn, state) -> str | None:
    """What is wrong with ``select``'s answer for one ``state`` (None: nothing): every running request runs first,
    in order; then the waiting ones in order, each admitted exactly when the batch has a seat and it fits."""
    running, waiting, n_rsrv, max_num_seqs, n_slots = state
    result = select(list(running), list(waiting), n_rsrv, max_num_seqs, n_slots)
    if not (isinstance(result, tuple) and len(result) == 2):
        return f"select must return (batch, n_rsrv), got {result!r}"
    batch, new_n_rsrv = result
    ids = [r.request_id for r in batch]
    if ids[:len(running)] != [r.request_id for r in running]:
        return "every running request must run, first, in its order"
    admitted, seats, rsrv = ids[len(running):], len(running), n_rsrv
    for req in waiting:
        fits = seats < max_num_seqs and rsrv + req.max_num_tokens <= n_slots
        if fits != (req.request_id in admitted):
            why = (f"{req.request_id} fits ({rsrv} + {req.max_num_tokens} <= {n_slots}, a seat free) but was not "
                   "admitted" if fits else f"{req.request_id} was admitted though it does not fit or the batch is full")
            return f"{len(running)} running, {len(waiting)} waiting, n_slots {n_slots}: {why}"
        if fits:
            seats, rsrv = seats + 1, rsrv + req.max_num_tokens
    if admitted != [r.request_id for r in waiting if r.request_id in admitted]:
        return "admitted requests must keep their arrival order"
    if new_n_rsrv != rsrv:
        return f"n_rsrv must grow by the admitted requests' reservations: {rsrv}, got {new_n_rsrv}"
    return None


@exercise.check(hint="like Algorithm 1's Select, but a waiting request that does not fit is skipped (continue, not "
                     "break); stop only when the batch is full; add each admitted reservation to n_rsrv")
def check_skip_ahead(select: SelectFn, num_steps: int = 200) -> str:
    """The exercise: ``select`` must admit, in arrival order, every waiting request that fits when it is considered
    (:func:`skip_ahead_problem` on random states). Then both selects :func:`replay` a :func:`stream`: the message
    says when the long request L first runs under each (starvation: never, within ``num_steps``)."""
    exercise.require(select([], [], 0, 4, 100), "my_select_skip_ahead(...)")
    for state in skip_ahead_states():
        problem = skip_ahead_problem(select, state)
        assert problem is None, problem
    fcfs = replay(_algorithm1, stream(), 8, 100, num_steps).get("L")
    mine = replay(select, stream(), 8, 100, num_steps).get("L")
    return (f"your select admits every request that fits; on a stream of short requests L first runs at step {fcfs} "
            "under Algorithm 1, " + (f"at step {mine} under yours" if mine is not None else
                                     f"and never within {num_steps} steps under yours: it starves"))


def mark_capacity(fig, n_slots: int) -> None:
    """A dashed line at ``n_slots`` (the KV capacity both policies got) on every KV strip of a
    :func:`~minibatch.viz.compare_gantt` figure (its axes 1, 3, ...), and in the first strip's legend."""
    strips = fig.axes[1::2]
    for ax in strips:
        ax.axhline(n_slots, color="black", ls="--", lw=1, label=f"n_slots = {n_slots}")
        ax.set_ylim(0, max(ax.get_ylim()[1], n_slots * 1.12))
    strips[0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
