"""What every scheduler hands the executor, and the interface schedulers share.

Schedulers are pure Python: they decide *which* requests run this step and *how many new tokens*
each computes; they never touch tensors (nano-vllm's split between Scheduler and ModelRunner).
"""

from __future__ import annotations

from minibatch.request import Request, RequestStatus
from minibatch.scheduler.config import SchedulerConfig
from minibatch.scheduler.output import PACKED, SchedulerOutput, StepResult
from minibatch.scheduler.queue_policy import QueuePolicy, make_queue_policy


class Scheduler:
    """Base class. A subclass implements ``schedule(now_s)`` and ``update(plan, result)``.

    ``waiting`` holds arrived requests not yet admitted, ``running`` the admitted ones. The
    engine calls ``add_request`` when a request's arrival_time_s has passed.

    queue_policy: "fcfs" (default), "sjf", "priority" or a
        :class:`~minibatch.scheduler.queue_policy.QueuePolicy`; iteration-level schedulers serve
        requests in the order of ``sort_key`` (the policy's key, ties broken by arrival).

    Raises:
        ValueError: ``queue_policy`` is neither one of those names nor a QueuePolicy (``make_queue_policy``).
    """

    name = "base"
    layout = PACKED  # the batch layout its steps use: "packed" (selective batching) or "padded"
    config_cls = SchedulerConfig  # its settings (scheduler/config.py); from_config reads them
    pages_kv = False  # its requests' KV lives in block tables a KV block map can draw (the paged schedulers)
    block_manager = None  # Orca's and the paged schedulers' BlockManager: read by kv/ and scheduler/ only; others
    # ask the scheduler (kv_geometry, kv_capacity_slots, make_stats, block_ref_counts), as vLLM's
    # get_kv_cache_usage() / make_stats()

    @classmethod
    def from_config(cls, config) -> "Scheduler":
        """A scheduler built from its settings, a ``config_cls`` instance."""
        raise NotImplementedError(f"{cls.__name__} does not define from_config")

    @classmethod
    def queue_policy_from(cls, config) -> QueuePolicy:
        """The order of service a config asks for (a scheduler with an order of its own overrides this)."""
        return make_queue_policy(config.queue_policy, config.aging_s)

    def __init__(self, queue_policy: str | QueuePolicy = "fcfs"):
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # preempted with their KV swapped to CPU memory (paged schedulers)
        self.rows: dict[str, int] = {}  # request_id -> batch row (Gantt row) of running requests
        self.queue_policy = make_queue_policy(queue_policy)
        self._num_added = 0  # requests added so far: the next one's order of arrival (the tie-breaker)
        self._arrival_order: dict[str, int] = {}  # request_id -> order of arrival
        # request_id -> sort key, computed once when the request is added: only for a policy whose keys never change
        self._keys: dict[str, tuple] | None = {} if self.queue_policy.static else None

    def sort_key(self, request: Request) -> tuple:
        """Smaller = served first (and preempted last): the queue policy's key, then arrival order.
        Every step sorts the waiting queue by it, so a static policy's keys are looked up, not rebuilt."""
        if self._keys is not None:
            return self._keys[request.request_id]
        return (*self.queue_policy.key(request), self._arrival_order[request.request_id])

    def take_row(self, request_id: str) -> int:
        """Give a newly running request the lowest free batch row (its Gantt row)."""
        used = set(self.rows.values())
        self.rows[request_id] = next(i for i in range(len(used) + 1) if i not in used)
        return self.rows[request_id]

    def add_request(self, request: Request) -> None:
        rid, self._num_added = request.request_id, self._num_added + 1
        if self._keys is not None:
            self._keys[rid] = (*self.queue_policy.key(request), self._num_added)
        else:
            self._arrival_order[rid] = self._num_added
        self.waiting.append(request)

    def forget(self, requests: list[Request]) -> None:
        """Drop the order-of-service state of requests that left for good (finished or aborted), so a long-running
        server's scheduler holds it only for the requests it still serves. The engine calls it after each step."""
        for r in requests:
            self._arrival_order.pop(r.request_id, None)
            if self._keys is not None:
                self._keys.pop(r.request_id, None)

    def observe_step(self, record) -> None:
        """Called by the engine after every step with its StepRecord (the measured or simulated
        duration included); schedulers that adapt to step times (adaptive chunking) override it."""

    def check_request(self, request: Request) -> None:
        """Raise ValueError if ``request`` could never be admitted (e.g. larger than the KV cache)."""

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request: Request, reason: str = "abort") -> None:
        """Take ``request`` out of every queue (waiting, running or swapped) and free its KV at
        once (``free_kv``); it is then finished with finish_reason ``reason`` (vLLM's
        ``finish_requests``: "abort" for a client that left, "stop" for a stop string found
        outside the engine). Called between steps only."""
        rid = request.request_id
        for queue in (self.waiting, self.running, self.swapped):
            queue[:] = [r for r in queue if r.request_id != rid]
        self.rows.pop(rid, None)
        self.free_kv(request)
        self.forget([request])
        request.spec_token_ids = []
        request.finish_reason = reason
        request.status = RequestStatus.FINISHED

    def free_kv(self, request: Request) -> None:
        """Give back whatever KV ``request`` holds: its blocks in the block manager, on the GPU or
        (swapped out) on the CPU. A static batch has none of its own: the row stays padding."""
        if self.block_manager is not None:
            self.block_manager.free_any(request.request_id)

    def schedule(self, now_s: float) -> SchedulerOutput:
        """This step's plan at time ``now_s`` (seconds on the engine's clock): which requests run and how many new
        tokens each computes (``num_new_tokens``), their block tables, and the blocks to copy, swap out and swap
        in before the forward. An empty plan may carry ``wake_time_s``, when to ask again."""
        raise NotImplementedError

    def update(self, plan: SchedulerOutput, result: StepResult) -> list[Request]:
        """Advance state after the forward: num_computed_tokens, new tokens, drafts, finishing.
        Returns the requests that finished this step."""
        raise NotImplementedError

    @staticmethod
    def advance(plan: SchedulerOutput, result: StepResult) -> list[Request]:
        """The common part of ``update``: each scheduled request's num_computed_tokens grows by its
        num_new_tokens, it gets its sampled tokens (if any) and its drafts for the next step.
        Returns the requests that finished.

        A speculative step (draft tokens verified) computed the last token and the drafts, but
        only the accepted drafts' KV is kept: num_computed_tokens grows by 1 + accepted, i.e.
        the rejected positions are rolled back (their slots are overwritten later); the request
        keeps (drafted, accepted) in ``spec_history``. Tokens after one that finishes the request
        (EOS, max_new_tokens) are dropped.
        """
        finished = []
        for s in plan.scheduled:
            r = s.request
            if s.spec_token_ids:
                accepted = result.num_accepted[r.request_id]
                r.num_computed_tokens += 1 + accepted
                r.spec_history.append((s.num_spec_tokens, accepted))
            else:
                r.num_computed_tokens += s.num_new_tokens
            logprobs = result.logprobs.get(r.request_id, ())
            for i, t in enumerate(result.sampled.get(r.request_id, ())):
                r.append_token(t)
                if i < len(logprobs):
                    r.logprobs.append(logprobs[i])
                if r.is_finished:
                    break
            r.spec_token_ids = [] if r.is_finished else list(result.spec_token_ids.get(r.request_id, ()))
            if r.is_finished:
                finished.append(r)
        return finished

    # --- what the engine, reports and metrics may ask about the KV cache ---
    def kv_geometry(self) -> tuple[int, int, int] | None:
        """(num_blocks, block_size, num_cpu_blocks) of the KV cache this scheduler hands out (the executor
        allocates it), or None: no block manager (a static batch keeps its KV in padded rows)."""
        bm = self.block_manager
        return None if bm is None else (bm.num_blocks, bm.block_size, bm.num_cpu_blocks)

    def kv_capacity_slots(self, max_model_len: int) -> int:
        """KV token slots this scheduler can hand out: its blocks x block_size (a static batch: its rows x
        ``max_model_len``, see StaticScheduler)."""
        bm = self.block_manager
        return 0 if bm is None else bm.num_blocks * bm.block_size

    def kv_cache_usage(self) -> float:
        """The share of KV blocks in use, in [0, 1] (vLLM's kv_cache_usage_perc); 0 without a block manager."""
        bm = self.block_manager
        return 0.0 if bm is None else 1.0 - bm.num_free_blocks / max(1, bm.num_blocks)

    def prefix_cache_counts(self) -> tuple[int, int] | None:
        """(prompt tokens found in the prefix cache, prompt tokens looked up) so far; None with prefix caching off
        (several schedulers' counts add up to a cluster's hit rate)."""
        bm = self.block_manager
        if bm is None or not bm.enable_prefix_caching:
            return None
        return bm.num_prefix_hit_tokens, bm.num_prefix_query_tokens

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of ``request``'s prompt whose KV this scheduler's prefix cache holds now, in full blocks (the lookup
        admission makes, nothing counted or changed); 0 with prefix caching off. A cluster router asks it."""
        bm = self.block_manager
        return 0 if bm is None else len(bm.get_computed_blocks(request)) * bm.block_size

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (their KV may have been overwritten by another engine)."""
        if self.block_manager is not None:
            self.block_manager.reset_prefix_cache()

    def make_stats(self) -> dict:
        """Run statistics of the scheduler's own, for a run's row: with prefix caching, "prefix_cache_hit_rate"
        (prompt tokens found cached / looked up) and "num_prefix_hit_tokens"; else nothing."""
        bm = self.block_manager
        if bm is None or not bm.enable_prefix_caching:
            return {}
        return {"prefix_cache_hit_rate": bm.prefix_cache_hit_rate, "num_prefix_hit_tokens": bm.num_prefix_hit_tokens}

    def block_ref_counts(self, request_id: str) -> list[int]:
        """ref_cnt of each block of ``request_id``'s block_table (copy-on-write sharing), [] without blocks."""
        bm = self.block_manager
        if bm is None:
            return []
        return [bm.blocks[b].ref_cnt for b in bm.block_tables.get(request_id, [])]

    # --- accounting shown in every StepRecord ---
    @property
    def num_kv_slots_used(self) -> int:
        """KV slots holding computed tokens."""
        return sum(r.num_computed_tokens for r in self.running)

    @property
    def num_kv_slots_reserved(self) -> int:
        """KV slots set aside (Orca reserves prompt + max_new_tokens at admission)."""
        return self.num_kv_slots_used
