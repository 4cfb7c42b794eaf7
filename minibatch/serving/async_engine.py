"""A front end for live traffic: the engine's step loop in one background thread, an async token
stream per request, aborts, and a bounded waiting queue.

Continuous batching is what makes a server of one model work (Orca, OSDI'22 §3): requests join
the running batch at the next iteration, whenever they arrive. Here they arrive from clients, at
any time: ``submit`` hands a request to the loop thread and yields its tokens as the steps that
compute them end; ``abort`` (a client that went away) frees the request's KV blocks at the next
step boundary. The engine runs on a :class:`~minibatch.clock.LiveClock` (real time).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from minibatch.engine import Engine
from minibatch.request import Request, SamplingParams

MAX_HISTORY = 10_000  # finished requests and StepRecords a server keeps without keep_history
IDLE_POLL_S = 0.005  # how often the loop looks again while requests wait (a static batch filling up)


def warm_up(engine: Engine, num_prompt_tokens: int = 16, max_new_tokens: int = 4, max_steps: int = 64) -> float:
    """Run one short greedy request through ``engine``, a throwaway engine on the server's runners, before the
    server listens; returns its seconds. A model's first forwards pay one-time costs (oneDNN primitives and weight
    packing on a CPU, allocations; on a GPU the CUDA graph of batch 1, other batch sizes are still recorded at their
    first step), which would otherwise land in the first users' TTFT; vLLM too runs dummy forwards before it serves.
    The served engine is a fresh one: none of this request's steps, statistics or cached blocks are in it.

    Best effort: at most ``max_steps`` steps, and a scheduler that cannot run a lone request (a policy of one's own
    that waits for a batch) only costs the warm-up (a warning line); the request is aborted whatever happens.

    Raises:
        ValueError: the KV cache does not fit in memory (as the served engine's first step would raise)."""
    fits = engine.max_request_tokens()  # (a KV cache too small for any request: nothing runs, the caller refuses)
    new = min(max_new_tokens, fits // 2)
    vocab, t0 = engine.executor.vocab_size, time.perf_counter()
    prompt = [3 + i % max(vocab - 3, 1) for i in range(min(num_prompt_tokens, fits - new))]
    if isinstance(getattr(engine.scheduler, "max_wait_s", None), (int, float)):  # a padded batch need not wait
        engine.scheduler.max_wait_s = 0.0
    try:
        if new:
            engine.add_request(Request("warmup", prompt, new, SamplingParams(ignore_eos=True)))
        for _ in range(max_steps):
            if not engine.has_unfinished():
                break
            engine.step()
    except RuntimeError as e:  # the scheduler cannot run it: serve anyway, cold
        print(f"warning: no warm-up ({e})", flush=True)
    finally:
        engine.abort_request("warmup")
    return time.perf_counter() - t0


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_num_waiting`` requests: retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The step loop stopped on an error; the message says which."""


@dataclass(frozen=True)
class TokenDelta:
    """What one engine step produced for one request: ``token_ids`` (>= 1 when drafts were
    accepted, empty for the final delta of an aborted request) and, on the last delta,
    ``finish_reason`` ("stop", "length" or "abort")."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None


class AsyncEngine:
    """Runs ``engine.step()`` in a daemon thread while requests come and go.

    Args:
        engine: an :class:`~minibatch.engine.Engine`, best on a ``LiveClock`` (requests are
            stamped with the clock's ``now_s`` when submitted, so they arrive at once).
        max_num_waiting: the most requests that may wait for admission (submitted, not yet
            running, less the free running slots they will take at the next step; preempted ones count); one more
            raises :class:`QueueFullError`. >= 1.
        keep_history: keep every finished request in ``engine.requests`` and every StepRecord in
            ``engine.trace`` (tests and notebooks read them); otherwise a long-running server
            keeps the last ``MAX_HISTORY`` finished requests and ``MAX_HISTORY`` records (a finished
            member of a static batch stays in its padded batch for a while, so not fewer).
        on_step: called in the loop thread after every step as ``on_step(engine, record)`` and
            after aborts as ``on_step(engine, None, aborted_requests)``: the server's metrics.

    Every engine call happens in the loop thread or under its lock, between steps.
    """

    def __init__(self, engine: Engine, max_num_waiting: int = 256, keep_history: bool = False,
                 on_step: Callable[..., None] | None = None):
        from minibatch.checks import check_int

        self.engine = engine
        self.max_num_waiting = check_int(max_num_waiting, "max_num_waiting", 1)
        self.on_step = on_step
        self.keep_history = keep_history
        self._finished: collections.deque[str] = collections.deque()  # oldest first
        self._lock = threading.Lock()  # guards the inbox and the streams table
        self._inbox: list[tuple[str, object]] = []  # ("add", Request) | ("abort", (request_id, reason))
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self.draining = False  # set by drain(): new requests are refused
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="minibatch-engine", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def run_in_this_thread(self) -> None:
        """Run the loop in the calling thread instead of a new one (returns when it stops): ``serve`` builds the
        model and the engine in one thread and steps it there, so the process has one OpenMP thread pool.

        Why: GNU OpenMP keeps a pool of worker threads per thread that starts parallel regions, and once the
        pools together hold more threads than the machine has cores it stops letting idle workers spin between
        regions; each region then waits for its workers to wake. Measured on a 2-core CPU: a oneDNN bf16
        matrix-vector product 2.7x slower, and a 1-request decode step of SmolLM2-135M 27.4 -> 36.2 ms, when the
        main thread had run torch work before another thread stepped the engine."""
        self._thread = threading.current_thread()
        self._loop()

    def drain(self, timeout_s: float) -> int:
        """Graceful shutdown, first half: refuse new requests (``submit`` raises QueueFullError, HTTP 503) and wait
        up to ``timeout_s`` for the requests already in to finish; returns how many are still open (``shutdown``
        then ends each with finish_reason "abort")."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.is_alive and time.monotonic() < deadline:
            with self._lock:
                if not self._streams and not self._inbox:
                    break
            time.sleep(0.02)
        with self._lock:
            return len(self._streams)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop thread (after the step in flight) and end every open stream with "abort"."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def num_waiting(self) -> int:
        """Requests submitted but not running: in the inbox, not yet arrived, or waiting in the scheduler."""
        with self._lock:
            inbox = sum(1 for kind, _ in self._inbox if kind == "add")
        return inbox + len(self.engine.pending) + len(self.engine.scheduler.waiting)

    def num_free_running_slots(self) -> int:
        """Running slots (``max_num_seqs``) not taken: that many submitted requests will be admitted at the next
        step rather than wait, so they do not count against ``max_num_waiting`` (a burst to an idle server is
        not refused while it has room). 0 for schedulers without max_num_seqs (static batches wait to fill)."""
        scheduler = self.engine.scheduler
        return max(0, getattr(scheduler, "max_num_seqs", 0) - len(scheduler.running) - len(scheduler.swapped))

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request) -> AsyncIterator[TokenDelta]:
        """Check and queue ``request`` now (call it from a running event loop); returns the async
        iterator of its TokenDeltas, until the one with a finish_reason. Leaving the iteration
        early (a client that disconnected: the iterator is closed or cancelled) aborts the
        request and frees its KV.

        Raises:
            ValueError / TypeError: the request can never run (``Engine.check_request``).
            ValueError: its request_id was already submitted (or added to the engine).
            QueueFullError: ``max_num_waiting`` requests already wait, or the server is draining (checked first).
            EngineDeadError: the loop thread has stopped.
            RuntimeError: no running event loop in this thread (``asyncio.get_running_loop``).
        """
        if self.draining:  # first: once drained, the loop has stopped too, and the answer is still "shutting down"
            raise QueueFullError("the server is shutting down (draining): no new requests")
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running: {self.error!r}")
        request.arrival_time_s = max(0.0, self.engine.clock.now_s)
        self.engine.check_request(request)
        if self.num_waiting() - self.num_free_running_slots() >= self.max_num_waiting:
            raise QueueFullError(f"the waiting queue is full (max_num_waiting={self.max_num_waiting}): retry later")
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request.request_id in self._streams or request.request_id in self.engine.requests:
                raise ValueError(f"request_id {request.request_id!r} was already submitted")
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
            self._inbox.append(("add", request))
        self._wake.set()
        return self._stream(request.request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[TokenDelta]:
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                if isinstance(delta, BaseException):
                    finished = True
                    raise delta
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Abort a request at the next step boundary (thread-safe; unknown or finished: no-op).
        reason: its finish_reason ("stop" when the front end found a stop string)."""
        with self._lock:
            self._inbox.append(("abort", (request_id, reason)))
        self._wake.set()

    # ------------------------------------------------------------------ the loop thread
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
            if entry is not None and (isinstance(item, BaseException) or item.finish_reason is not None):
                del self._streams[request_id]
        if entry is not None:
            loop, queue = entry
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the client's event loop is closed: nobody is listening
                pass

    def _apply_inbox(self) -> list[Request]:
        with self._lock:
            commands, self._inbox = self._inbox, []
        aborted = []
        for kind, value in commands:
            if kind == "add":
                try:
                    self.engine.add_request(value)
                except (TypeError, ValueError) as e:  # checked at submit; a race (same id) lands here
                    self._deliver(value.request_id, e)
            elif self.engine.abort_request(*value):
                aborted.append(self.engine.requests[value[0]])
                self._deliver(value[0], TokenDelta((), value[1]))
        return aborted

    def _forget(self, finished_ids) -> None:
        self._finished.extend(finished_ids)
        while len(self._finished) > MAX_HISTORY:
            self.engine.requests.pop(self._finished.popleft(), None)
        if len(self.engine.trace) > 2 * MAX_HISTORY:
            del self.engine.trace[:-MAX_HISTORY]

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                aborted = self._apply_inbox()
                if aborted and self.on_step:
                    self.on_step(engine, None, aborted)
                if aborted and not self.keep_history:
                    self._forget([r.request_id for r in aborted])
                if not engine.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                record = engine.step()
                if record is None:  # only waiting (e.g. a static batch filling up)
                    self._wake.wait(IDLE_POLL_S)
                    self._wake.clear()
                    continue
                if self.on_step:  # first, so a client that has its last token reads /metrics of after the step
                    self.on_step(engine, record)
                for e in record.entries:
                    if not e.token_ids and e.request_id not in record.finished:
                        continue  # a prefill chunk: nothing to send yet
                    reason = engine.requests[e.request_id].finish_reason if e.request_id in record.finished else None
                    self._deliver(e.request_id, TokenDelta(tuple(e.token_ids), reason))
                if not self.keep_history:
                    self._forget(record.finished)
        except BaseException as e:  # noqa: BLE001 -- every open stream must learn why it ends
            self.error = e
        finally:
            with self._lock:
                open_ids = list(self._streams)
            for rid in open_ids:
                self._deliver(rid, EngineDeadError(f"the engine loop stopped: {self.error!r}") if self.error
                              else TokenDelta((), "abort"))
