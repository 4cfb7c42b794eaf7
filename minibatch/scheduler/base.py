"""What every scheduler hands the executor, and the interface schedulers share.

Schedulers are pure Python: they decide *which* requests run this step and *how many new tokens*
each computes; they never touch tensors (nano-vllm's split between Scheduler and ModelRunner).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minibatch.request import Request
from minibatch.scheduler.queue_policy import QueuePolicy, make_queue_policy


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    num_new_tokens: tokens computed this step (prompt length for a whole prefill, 1 for a decode).
    phase: "prefill" or "decode".
    slot: batch slot index: which of the batch's max_bs rows the request occupies (the row of the
        Gantt chart). Not a KV slot: KV slots (n_slots, slot_mapping) hold one token's K/V each.
    num_spec_tokens: speculative decoding: draft tokens the scheduler made room for (k); the
        step then computes num_new_tokens = 1 + k tokens (the last token and the drafts).
    spec_token_ids: the draft tokens the executor's proposer filled in (at most num_spec_tokens;
        a proposer that finds fewer, like n-gram lookup, shrinks num_new_tokens to match).
    """

    request: Request
    num_new_tokens: int
    phase: str
    slot: int
    num_spec_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerOutput:
    """A step's plan.

    scheduled: requests that compute tokens this step, in batch order.
    padded: static batching only: members that already finished but still occupy a row of the
        padded (B, T) batch, so they cost a padding token each.
    is_padded_batch: run as a padded (B, T) batch (static batching) rather than packed
        (num_tokens,) (selective batching).
    new_batch: static batching: this step starts a new batch (the executor resets its cache).
    num_padding_tokens: tokens computed that belong to no request (prompt left-padding plus
        finished rows), counted by the scheduler.
    num_idle_slots: batch slots holding no request this step.
    wake_time_s: when nothing is scheduled, the earliest time the scheduler may decide
        differently (static batching's max wait), or None.
    block_tables: request_id -> the request's KV block ids (packed batches; the runner turns
        them into slot_mapping).
    blocks_to_copy: copy-on-write (src_block, dst_block) pairs the runner copies before the forward.
    blocks_to_swap_out: (gpu_block, cpu_block) pairs of requests preempted by swap this step;
        blocks_to_swap_in: (cpu_block, gpu_block) pairs of requests coming back. The runner does
        swap-outs first, then swap-ins, then copies, then the forward.
    preempted: request_ids preempted this step (by recompute or swap).
    draft_time_s, draft_forwards: filled by a speculative executor: seconds spent proposing,
        and (rows, tokens, context tokens) of each draft forward (simulated clocks charge them).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    padded: list[ScheduledRequest] = field(default_factory=list)
    is_padded_batch: bool = False
    new_batch: bool = False
    num_padding_tokens: int = 0
    num_idle_slots: int = 0
    wake_time_s: float | None = None
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    draft_time_s: float = 0.0
    draft_forwards: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Base class. A subclass implements ``schedule(now_s)`` and ``update(output, sampled)``.

    ``waiting`` holds arrived requests not yet admitted, ``running`` the admitted ones. The
    engine calls ``add_request`` when a request's arrival_time_s has passed.

    queue_policy: "fcfs" (default), "sjf", "priority" or a
        :class:`~minibatch.scheduler.queue_policy.QueuePolicy`; iteration-level schedulers serve
        requests in the order of ``sort_key`` (the policy's key, ties broken by arrival).
    """

    name = "base"

    def __init__(self, queue_policy: str | QueuePolicy = "fcfs"):
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.slots: dict[str, int] = {}  # request_id -> batch slot (Gantt row) of running requests
        self.queue_policy = make_queue_policy(queue_policy)
        self._arrival_order: dict[str, int] = {}  # request_id -> order of arrival (the tie-breaker)

    def sort_key(self, request: Request) -> tuple:
        """Smaller = served first (and preempted last): the queue policy's key, then arrival order."""
        return (*self.queue_policy.key(request), self._arrival_order[request.request_id])

    def take_slot(self, request_id: str) -> int:
        """Give a newly running request the lowest free batch slot (its Gantt row)."""
        used = set(self.slots.values())
        self.slots[request_id] = next(i for i in range(len(used) + 1) if i not in used)
        return self.slots[request_id]

    def add_request(self, request: Request) -> None:
        self._arrival_order[request.request_id] = len(self._arrival_order)
        self.waiting.append(request)

    def observe_step(self, record) -> None:
        """Called by the engine after every step with its StepRecord (the measured or simulated
        duration included); schedulers that adapt to step times (adaptive chunking) override it."""

    def check_request(self, request: Request) -> None:
        """Raise ValueError if ``request`` could never be admitted (e.g. larger than the KV cache)."""

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now_s: float) -> SchedulerOutput:
        raise NotImplementedError

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance state after the forward: num_computed_tokens, new tokens, finishing.

        sampled: request_id -> token id, for each scheduled request whose step produced a token;
            a list of token ids for a speculative step (accepted draft tokens, then one more).
        Returns the requests that finished this step.
        """
        raise NotImplementedError

    @staticmethod
    def advance(output: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """The common part of ``update``: each scheduled request's num_computed_tokens grows by its
        num_new_tokens and it gets its sampled token (if any). Returns the requests that finished.

        A speculative step (draft tokens verified) computed the last token and the drafts, but
        only the accepted drafts' KV is kept: num_computed_tokens grows by 1 + accepted, i.e.
        the rejected positions are rolled back (their slots are overwritten later). Tokens after
        one that finishes the request (EOS, max_new_tokens) are dropped.
        """
        finished = []
        for s in output.scheduled:
            r = s.request
            tokens = sampled.get(r.request_id)
            tokens = [] if tokens is None else tokens if isinstance(tokens, list) else [tokens]
            r.num_computed_tokens += len(tokens) if s.spec_token_ids else s.num_new_tokens
            for t in tokens:
                r.append_token(t)
                if r.is_finished:
                    break
            if r.is_finished:
                finished.append(r)
        return finished

    # --- accounting shown in every StepRecord ---
    @property
    def num_kv_slots_used(self) -> int:
        """KV slots holding computed tokens."""
        return sum(r.num_computed_tokens for r in self.running)

    @property
    def num_kv_slots_reserved(self) -> int:
        """KV slots set aside (Orca reserves prompt + max_new_tokens at admission)."""
        return self.num_kv_slots_used
