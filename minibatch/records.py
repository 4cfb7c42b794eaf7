"""What one engine step leaves behind: a :class:`StepRecord` per step (the schedule trace that
plots, metrics, clocks and the simulator's fit read), a :class:`StepEntry` per batch row, and the
:class:`TokenEvent` a stream yields."""

from __future__ import annotations

from dataclasses import dataclass, field

from minibatch.request import Request
from minibatch.scheduler.base import Scheduler
from minibatch.scheduler.output import PACKED, SchedulerOutput, StepResult


@dataclass
class StepEntry:
    """One batch row of a step: which request, in which batch row, doing what.

    phase: "prefill" | "decode" | "padding" (a finished member of a static batch whose row still
    computes a token: its last one, fed again). num_computed_tokens is the value *before* this step.
    sampled: the step produced a token for the request (False for a prefill chunk that does not
    reach the prompt's end, and for padding).
    num_spec_tokens, num_accepted_tokens: speculative decoding: draft tokens verified in this row
    (num_new_tokens = 1 + num_spec_tokens) and how many were accepted.
    token_ids: the tokens the request got this step (after one that finished it: none).
    """

    request_id: str
    row: int
    phase: str
    num_new_tokens: int
    num_computed_tokens: int
    sampled: bool = True
    num_spec_tokens: int = 0
    num_accepted_tokens: int = 0
    token_ids: tuple[int, ...] = ()

    @property
    def is_chunk(self) -> bool:
        """A partial prefill: a prompt slice that does not reach the prompt's end (chunked prefill)."""
        return self.phase == "prefill" and not self.sampled


@dataclass
class StepRecord:
    """What happened in one step; the list of these is the schedule trace.

    Built by the engine from the step's plan, its result and its clock (:meth:`of`); everything
    plots, metrics, the simulator's fit and the clocks read. Times are seconds on the engine
    clock. num_kv_slots_used counts KV slots holding computed tokens, num_kv_slots_reserved the
    slots set aside (Orca reserves prompt + max_new_tokens).

    layout: "packed" or "padded" (static batching's (B, T) batch). num_blocks_swapped_out,
    num_blocks_swapped_in, num_blocks_copied: KV blocks moved before the forward (swap preemption,
    copy-on-write). draft_forwards: (rows, tokens, context tokens) of each draft-model forward the
    step ran (speculative decoding), draft_time_s their share of the step.
    """

    step: int
    start_s: float
    end_s: float
    entries: list[StepEntry]
    num_padding_tokens: int
    num_idle_rows: int
    num_kv_slots_used: int
    num_kv_slots_reserved: int
    num_waiting: int
    num_running: int
    finished: list[str] = field(default_factory=list)
    block_tables: dict[str, tuple[int, ...]] = field(default_factory=dict)  # request_id -> KV block ids
    preempted: list[str] = field(default_factory=list)  # request_ids preempted this step
    draft_time_s: float = 0.0
    layout: str = PACKED
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    num_blocks_copied: int = 0
    draft_forwards: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def of(cls, step: int, plan: SchedulerOutput, result: StepResult, outputs_before: list[int],
           finished: list[Request], scheduler: Scheduler, start_s: float,
           previous: "StepRecord | None" = None) -> "StepRecord":
        """The record of a step just updated: ``outputs_before`` holds each scheduled request's
        num_output_tokens before the update. Its times are the clock's to fill (end_s = start_s,
        draft_time_s = the executor's measured drafting); num_waiting counts the scheduler's queue
        now. A block table unchanged since ``previous`` is that record's tuple (shared), so a
        trace's memory grows with the blocks that change, not with steps x blocks held."""
        entries = [StepEntry(s.request_id, s.row, s.phase, s.num_new_tokens, s.num_computed_tokens,
                             s.request_id in result.sampled, s.num_spec_tokens,
                             result.num_accepted.get(s.request_id, 0),
                             tuple(s.request.output_token_ids[before:]))
                   for s, before in zip(plan.scheduled, outputs_before)]
        entries += [StepEntry(s.request_id, s.row, "padding", 1, s.num_computed_tokens, False) for s in plan.padded]
        old = previous.block_tables if previous is not None else {}
        return cls(
            step=step, start_s=start_s, end_s=start_s, entries=entries,
            num_padding_tokens=plan.num_padding_tokens, num_idle_rows=plan.num_idle_rows,
            num_kv_slots_used=scheduler.num_kv_slots_used, num_kv_slots_reserved=scheduler.num_kv_slots_reserved,
            num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
            finished=[r.request_id for r in finished],
            block_tables={rid: old[rid] if old.get(rid) == t else t for rid, t in plan.block_tables.items()},
            preempted=list(plan.preempted), draft_time_s=result.draft_time_s, layout=plan.layout,
            num_blocks_swapped_out=len(plan.blocks_to_swap_out), num_blocks_swapped_in=len(plan.blocks_to_swap_in),
            num_blocks_copied=len(plan.blocks_to_copy), draft_forwards=tuple(result.draft_forwards),
        )

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def num_blocks_moved(self) -> int:
        return self.num_blocks_swapped_out + self.num_blocks_swapped_in + self.num_blocks_copied

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries if e.phase != "padding")

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries if e.phase == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries if e.phase == "decode")


def first_steps(trace: list[StepRecord]) -> dict[str, int]:
    """request_id -> the first step of ``trace`` (StepRecords) that runs it, for every request in it."""
    out: dict[str, int] = {}
    for record in trace:
        for e in record.entries:
            out.setdefault(e.request_id, record.step)
    return out


@dataclass
class TokenEvent:
    """A token streamed out of the engine (time on the engine clock)."""

    request_id: str
    token_id: int
    time_s: float
    is_finished: bool
