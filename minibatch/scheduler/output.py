"""The step contract: what the scheduler plans and what the executor reports back.

    plan   = scheduler.schedule(now_s).freeze()   # SchedulerOutput; the engine freezes it: read-only
    result = executor.execute(plan)               # StepResult
    done   = scheduler.update(plan, result)

One writer per object (vLLM v1's SchedulerOutput / ModelRunnerOutput split): the scheduler writes
the plan, the executor the result, the engine the StepRecord built from both. Nobody patches an
earlier stage.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from minibatch.request import Request

PACKED, PADDED = "packed", "padded"  # the two batch layouts (see runner.model_runner)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    num_new_tokens: tokens computed this step (prompt length for a whole prefill, 1 for a decode,
        1 + len(spec_token_ids) for a speculative verification).
    phase: "prefill" or "decode".
    row: which of the batch's max_num_seqs rows the request occupies (the row of the Gantt chart).
        Not a KV slot: KV slots (n_slots, slot_mapping) hold one token's K/V each.
    spec_token_ids: speculative decoding: the draft tokens verified this step (the request's
        stored drafts, cut to fit the token budget and max_new_tokens).
    num_computed_tokens: the request's num_computed_tokens when the step was planned (filled in).
    """

    request: Request
    num_new_tokens: int
    phase: str
    row: int
    spec_token_ids: tuple[int, ...] = ()
    num_computed_tokens: int = -1

    def __post_init__(self):
        object.__setattr__(self, "spec_token_ids", tuple(self.spec_token_ids))
        if self.num_computed_tokens < 0:
            object.__setattr__(self, "num_computed_tokens", self.request.num_computed_tokens)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_spec_tokens(self) -> int:
        return len(self.spec_token_ids)

    @property
    def samples(self) -> bool:
        """The step reaches the request's last known token, so it samples (False for a prefill chunk)."""
        return self.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    """A step's plan; ``freeze()`` makes it read-only (the engine freezes it when schedule() returns).

    scheduled: requests that compute tokens this step, in batch order.
    padded: static batching only: members that already finished but still occupy a row of the
        padded (B, T) batch, so they cost a padding token each.
    layout: "packed" (num_tokens,) selective batching, or "padded" (B, T) static batching.
    new_batch: static batching: this step starts a new batch (the executor resets its cache).
    num_padding_tokens: tokens computed that belong to no request (prompt left-padding plus
        finished rows), counted by the scheduler.
    num_idle_rows: batch rows holding no request this step.
    wake_time_s: when nothing is scheduled, the earliest time the scheduler may decide
        differently (static batching's max wait), or None.
    block_tables: request_id -> the request's KV block ids (packed batches; the runner turns
        them into slot_mapping).
    blocks_to_copy: copy-on-write (src_block, dst_block) pairs the runner copies before the forward.
    blocks_to_swap_out: (gpu_block, cpu_block) pairs of requests preempted by swap this step;
        blocks_to_swap_in: (cpu_block, gpu_block) pairs of requests coming back. The runner does
        swap-outs first, then swap-ins, then copies, then the forward.
    preempted: request_ids preempted this step (by recompute or swap).
    token_budget: the most tokens this step may schedule (max_num_batched_tokens, or the adaptive
        chunker's choice), fixed when the step's planning begins; inf: no budget.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    padded: list[ScheduledRequest] = field(default_factory=list)
    layout: str = PACKED
    new_batch: bool = False
    num_padding_tokens: int = 0
    num_idle_rows: int = 0
    wake_time_s: float | None = None
    block_tables: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    token_budget: float = math.inf

    def freeze(self) -> "SchedulerOutput":
        """Lists become tuples, block tables are copied; any later assignment raises. Returns self."""
        if not getattr(self, "_frozen", False):
            for f in dataclasses.fields(self):
                if isinstance(getattr(self, f.name), list):
                    object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
            tables = MappingProxyType({rid: tuple(t) for rid, t in self.block_tables.items()})
            object.__setattr__(self, "block_tables", tables)
            object.__setattr__(self, "_frozen", True)
        return self

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise dataclasses.FrozenInstanceError(f"SchedulerOutput is frozen once scheduled; cannot set {name}")
        super().__setattr__(name, value)

    @property
    def is_padded_batch(self) -> bool:
        return self.layout == PADDED

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_blocks_moved(self) -> int:
        """KV blocks copied before the forward: swaps out and in, copy-on-write copies."""
        return len(self.blocks_to_swap_out) + len(self.blocks_to_swap_in) + len(self.blocks_to_copy)


@dataclass(frozen=True)
class StepResult:
    """What an executor reports for one step.

    sampled: request_id -> the tokens the step emitted for it: one for a plain row that reached its
        last token; for a verification, the accepted drafts then one more (the bonus or the
        correction). Prefill chunks that stop short of the prompt's end have no entry.
    num_accepted: request_id -> draft tokens accepted, for rows that verified drafts.
    spec_token_ids: request_id -> drafts proposed for the request's next step (speculative
        decoding; vLLM v1's order: the proposer runs after sampling). update() stores them on the
        request; the next schedule() verifies them (cut to fit the token budget).
    draft_forwards: (rows, tokens, context tokens) of each draft forward this step (simulated
        clocks price them); draft_time_s: measured seconds spent proposing.
    logprobs: request_id -> one {token id: logprob} per token in ``sampled``, for requests whose
        sampling asks for logprobs (``SamplingParams.logprobs``).
    """

    sampled: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    num_accepted: Mapping[str, int] = field(default_factory=dict)
    spec_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    draft_forwards: tuple[tuple[int, int, int], ...] = ()
    draft_time_s: float = 0.0
    logprobs: Mapping[str, tuple[dict[int, float], ...]] = field(default_factory=dict)
