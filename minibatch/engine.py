"""The engine: one loop that every scheduling technique plugs into.

    step() = schedule -> execute -> clock -> update -> record

Orca (Yu et al., OSDI'22) §3.1, iteration-level scheduling: an *iteration* is one forward of
the model over the batch; the scheduler runs again after every iteration, so requests can join
and leave at any step.

The engine only stamps events on requests (first scheduled, each token, finish) and appends a
:class:`StepRecord` per step; ``minibatch.metrics`` and ``minibatch.viz`` read them.
"""

from __future__ import annotations

import bisect
import heapq
import weakref
from typing import Iterator

from minibatch.checks import FieldTypeError, check_in_vocab, short_repr
from minibatch.clock import SimClock, StepShape, WallClock
from minibatch.records import StepRecord, TokenEvent
from minibatch.request import Request, RequestStatus, SamplingParams
from minibatch.scheduler.base import Scheduler
from minibatch.scheduler.output import SchedulerOutput


class Engine:
    """Runs requests through ``scheduler`` and ``executor`` on ``clock``.

    Args:
        scheduler: a :class:`~minibatch.scheduler.base.Scheduler` (static, orca, ...).
        executor: has ``execute(SchedulerOutput) -> StepResult``, ``eos_token_ids``,
            ``max_model_len``, ``vocab_size``, ``free(request_ids)``, ``claim(engine, kv_geometry)``,
            ``observe_step(record)`` and ``allocate_kv_cache(num_blocks, block_size, num_cpu_blocks)``;
            a ``ModelRunner``,
            ``SpeculativeRunner`` or ``SimExecutor``. Several engines may share one executor one
            after another (each claims its KV cache before a step), never interleaved while one
            still holds KV in it.
        clock: ``WallClock`` (measure) or ``SimClock`` (deterministic timeline); default SimClock,
            so pass a WallClock to time a real model.

    A request is never scheduled before its ``arrival_time_s``: requests wait in ``pending``
    (a heap by arrival) and reach the scheduler only once the clock has passed their arrival.
    """

    def __init__(self, scheduler: Scheduler, executor, clock: WallClock | SimClock | None = None):
        """Raises FieldTypeError: an executor or clock that is not one (a class, a name such as "sim")."""
        for name, obj, needs in (("executor", executor, ("execute", "free")),
                                 ("clock", clock, ("start_step", "end_step", "advance_to"))):
            if obj is not None and (isinstance(obj, type) or not all(callable(getattr(obj, m, None)) for m in needs)):
                raise FieldTypeError(f"{name} must be an object with {', '.join(needs)} (e.g. "
                                     + ("ModelRunner(...) or SimExecutor()" if name == "executor" else
                                        "SimClock() or WallClock()") + f"), got {short_repr(obj)}")
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock if clock is not None else SimClock()
        self.pending: list[tuple[float, int, Request]] = []  # heap of (arrival_time_s, order, request)
        self.requests: dict[str, Request] = {}  # every request ever added, by request_id
        self.trace: list[StepRecord] = []

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request; it reaches the scheduler at its arrival_time_s.

        Raises:
            TypeError: not a Request.
            ValueError: the request cannot ever run (a token id outside [0, vocab_size), too
                long for the model or the KV cache) or is not fresh. It is refused here, before
                it can reach a step, so a bad request never takes other requests down; requests
                are never silently dropped.
        """
        self.check_request(request)
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} was already added")
        if request.owner is not None and request.owner() not in (None, self):
            raise ValueError(f"request {request.request_id!r} was already added to another engine, which owns its "
                             "state; pass request.copy()")
        request.owner = weakref.ref(self)
        if not request.sampling.ignore_eos:
            request.eos_token_ids = tuple(self.executor.eos_token_ids)
        heapq.heappush(self.pending, (request.arrival_time_s, len(self.requests), request))
        self.requests[request.request_id] = request

    def check_request(self, request: Request) -> None:
        """Raise what ``add_request`` raises for a request that could never run (it reads the
        executor's and the scheduler's limits only, so a front end may call it from another thread)."""
        if not isinstance(request, Request):
            raise TypeError(f"add_request takes a Request, got {type(request).__name__}")
        vocab_size = getattr(self.executor, "vocab_size", None)
        if vocab_size is not None:
            try:
                check_in_vocab(request.prompt_token_ids, vocab_size)
            except ValueError as e:
                raise ValueError(f"request {request.request_id!r}: {e}") from None
        bad = next((t for t in request.sampling.stop_token_ids if vocab_size is not None and t >= vocab_size), None)
        if bad is not None:  # the first bad id, not a list that may be a million long
            raise ValueError(f"request {request.request_id!r}: stop_token_ids must be in [0, {vocab_size}) (the "
                             f"model's vocab_size), got {bad}")
        sampling = request.sampling
        if sampling.min_tokens and vocab_size is not None:  # what it bans (Request.banned_token_ids) must leave a token
            eos = () if sampling.ignore_eos else tuple(getattr(self.executor, "eos_token_ids", ()))
            if len({t for t in sampling.stop_token_ids + eos if t < vocab_size}) >= vocab_size:
                raise ValueError(f"request {request.request_id!r}: stop_token_ids{' and EOS' if eos else ''} cover "
                                 f"all {vocab_size} token ids (vocab_size), so none could be sampled while min_tokens "
                                 f"({sampling.min_tokens}) bans them: leave some token ids out, or use min_tokens 0")
        if request.sampling.min_tokens and not getattr(self.executor, "supports_min_tokens", True):
            raise ValueError(f"request {request.request_id!r}: min_tokens is not supported by "
                             f"{type(self.executor).__name__} (speculative decoding): use min_tokens 0")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} already ran; pass request.copy()")
        if request.num_speculative_tokens is not None and getattr(self.executor, "speculator", None) is None:
            raise ValueError(f"request {request.request_id!r}: num_speculative_tokens applies only under a "
                             "speculative policy (spec, spec_ngram)")
        if request.num_external_computed_tokens and not getattr(self.scheduler, "receives_external_kv", False):
            raise ValueError(f"request {request.request_id!r}: num_external_computed_tokens (KV from elsewhere) needs "
                             f"a paged scheduler, not {type(self.scheduler).__name__}: it would be computed again")
        max_len = self.executor.max_model_len
        if request.max_num_tokens > max_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt ({request.num_prompt_tokens}) + "
                f"max_new_tokens ({request.max_new_tokens}) must be <= max_model_len ({max_len})"
            )
        self.scheduler.check_request(request)

    def max_request_tokens(self) -> int:
        """The most tokens (prompt + max_new_tokens) one request may hold on this engine: the model's max_model_len, or
        fewer where the scheduler's KV cache (or its token budget) holds fewer: the largest total its
        ``check_request`` lets through both as a one-token prompt with the rest output and as the rest prompt with
        one output token (a binary search, ``bisect``; its checks read limits only). A front end's context (the
        server's default max_tokens). 1 when not even a one-token prompt with one output token fits."""
        def fits(total: int) -> bool:
            try:
                for prompt in (1, total - 1):
                    self.scheduler.check_request(Request("max_request_tokens", [0] * prompt, total - prompt,
                                                         SamplingParams(ignore_eos=True)))
            except ValueError:
                return False
            return True

        # the totals from 2 up that fit: the largest is 1 + their count (1 when none does)
        return 1 + bisect.bisect_right(range(2, self.executor.max_model_len + 1), False, key=lambda t: not fits(t))

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request whatever its state (not yet arrived, waiting, running, swapped) and free
        its KV blocks now; it finishes with finish_reason ``reason`` at the current clock time. Call
        it between steps. Returns False (and changes nothing) for an unknown or finished request.
        Under static batching the request's row stays in the padded batch until the batch ends."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        if any(r is request for _, _, r in self.pending):
            self.pending = [x for x in self.pending if x[2] is not request]
            heapq.heapify(self.pending)
        self.scheduler.abort(request, reason)  # also finishes it (a not-yet-arrived one too)
        self.executor.free([request_id])
        request.finish_time_s = max(self.clock.now_s, request.arrival_time_s)  # (not before it arrived)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.pending) or self.scheduler.has_unfinished()

    @property
    def holds_kv(self) -> bool:
        """Whether KV of this engine's requests sits in the executor's caches (running or swapped)."""
        return bool(self.scheduler.running or self.scheduler.swapped)

    def _claim_executor(self) -> None:
        """Take the executor's KV cache for this engine before a step (``KVOwnership.claim``):
        refused while another engine holds KV in it; on a change of hands, the cache gets this
        engine's geometry and the prefix cache forgets blocks another engine may have overwritten."""
        if self.executor.claim(self, self.scheduler.kv_geometry()):
            self.scheduler.reset_prefix_cache()

    def _admit_arrivals(self) -> None:
        while self.pending and self.pending[0][0] <= self.clock.now_s:
            self.scheduler.add_request(heapq.heappop(self.pending)[2])

    # ------------------------------------------------------------------ the loop
    def step(self) -> StepRecord | None:
        """Run one iteration. Returns its record, or None if the engine only waited (idle) or
        has nothing to do (no request added, or all finished: the clock does not move).

        Raises:
            RuntimeError: the executor is in use by another engine that holds KV in it.
            ValueError: this engine's KV cache does not fit in the device's free memory (found
                when the engine first claims the executor; nothing is admitted or changed).
            RuntimeError: the scheduler can schedule none of its waiting requests and nothing will
                arrive or wake it (the message lists them).
        """
        if not self.has_unfinished():
            return None
        self._claim_executor()
        self._admit_arrivals()
        start_s = self.clock.now_s
        self.clock.start_step()  # the wall clock times scheduling and the update too, not only the forward
        plan = self.scheduler.schedule(start_s).freeze()
        if plan.is_empty:
            self._wait_for_next_event(plan)
            return None
        result = self.executor.execute(plan)            # the forward pass (or the simulator)
        outputs_before = [s.request.num_output_tokens for s in plan.scheduled]
        finished = self.scheduler.update(plan, result)
        self.scheduler.forget(finished)
        self.executor.free([r.request_id for r in finished])
        entries = StepRecord.entries_of(plan, result, outputs_before)
        shape = StepShape.of_entries(entries, plan.num_padding_tokens, plan.layout)
        # measured, or priced by the cost model; advances now_s
        _, draft_time_s = self.clock.end_step(shape, result.draft_forwards, result.draft_time_s)
        end_s = self.clock.now_s
        for e in entries:                               # stamp events
            r = self.requests[e.request_id]
            if r.first_scheduled_time_s is None:
                r.first_scheduled_time_s = start_s
            r.token_times_s += [end_s] * len(e.token_ids)  # > 1 when drafts are accepted
        for r in finished:
            r.finish_time_s = end_s
        self._admit_arrivals()  # requests that arrived during the step count as waiting in its record
        record = StepRecord.of(len(self.trace), plan, result, entries, finished, self.scheduler, start_s, end_s,
                               draft_time_s, self.trace[-1] if self.trace else None)
        self.trace.append(record)
        self.scheduler.observe_step(record)
        self.executor.observe_step(record)
        return record

    def _wait_for_next_event(self, out: SchedulerOutput) -> None:
        times = [t for t in (out.wake_time_s, self.pending[0][0] if self.pending else None) if t is not None]
        if not times:
            waiting = [r.request_id for r in self.scheduler.waiting]
            raise RuntimeError(f"scheduler {self.scheduler.name} cannot schedule waiting requests {waiting}")
        self.clock.advance_to(min(times))

    # ------------------------------------------------------------------ front ends
    def stream(self, requests: list[Request] | None = None) -> Iterator[TokenEvent]:
        """Add ``requests`` and yield every token as its step ends, until all finish.

        Raises:
            as ``add_request`` (TypeError: not a Request; ValueError: a request that cannot run or is not fresh)
            and ``step`` (RuntimeError: the executor is held by another engine, or nothing can be scheduled;
            ValueError: the KV cache does not fit). A generator: nothing runs, or raises, before the first next().
        """
        for r in requests or []:
            self.add_request(r)
        while self.has_unfinished():
            record = self.step()
            for e in record.entries if record is not None else ():
                done = e.request_id in record.finished
                for j, token_id in enumerate(e.token_ids):
                    yield TokenEvent(e.request_id, token_id, record.end_s, done and j == len(e.token_ids) - 1)

    def generate(self, requests: list[Request], progress: bool = False) -> list[Request]:
        """Offline: run ``requests`` to completion; returns them (same order) with outputs filled.

        progress: show a tqdm bar over finished requests.

        Raises:
            as ``add_request`` (TypeError: not a Request; ValueError: a request that cannot run or is not fresh)
            and ``step`` (RuntimeError: the executor is held by another engine, or nothing can be scheduled;
            ValueError: the KV cache does not fit).
        """
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc=f"{self.scheduler.name}", unit="req", leave=False)
        for r in requests:
            self.add_request(r)
        while self.has_unfinished():
            record = self.step()
            if bar is not None and record is not None and record.finished:
                bar.update(len(record.finished))
        if bar is not None:
            bar.close()
        return requests
