"""What one engine step leaves behind: a :class:`StepRecord` per step (the schedule trace that
plots, metrics, clocks and the simulator's fit read), a :class:`StepEntry` per batch row, and the
:class:`TokenEvent` a stream yields."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

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
    step ran (speculative decoding), draft_time_s their share of the step. token_budget: the most
    tokens the step could schedule (max_num_batched_tokens, or the adaptive chunker's choice), None: no budget.
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
    token_budget: int | None = None

    @staticmethod
    def entries_of(plan: SchedulerOutput, result: StepResult, outputs_before: list[int]) -> list[StepEntry]:
        """A step's rows, once the scheduler applied ``result``: ``outputs_before`` holds each scheduled
        request's num_output_tokens before the update (its new tokens are the ones after)."""
        entries = [StepEntry(s.request_id, s.row, s.phase, s.num_new_tokens, s.num_computed_tokens,
                             s.request_id in result.sampled, s.num_spec_tokens,
                             result.num_accepted.get(s.request_id, 0),
                             tuple(s.request.output_token_ids[before:]))
                   for s, before in zip(plan.scheduled, outputs_before)]
        return entries + [StepEntry(s.request_id, s.row, "padding", 1, s.num_computed_tokens, False)
                          for s in plan.padded]

    @classmethod
    def of(cls, step: int, plan: SchedulerOutput, result: StepResult, entries: list[StepEntry],
           finished: list[Request], scheduler: Scheduler, start_s: float, end_s: float, draft_time_s: float,
           previous: "StepRecord | None" = None) -> "StepRecord":
        """The record of a step that ended at ``end_s`` (its rows: :meth:`entries_of`; draft_time_s: the
        clock's drafting seconds); num_waiting counts the scheduler's queue now. A block table unchanged
        since ``previous`` is that record's tuple (shared), so a trace's memory grows with the blocks
        that change, not with steps x blocks held."""
        old = previous.block_tables if previous is not None else {}
        return cls(
            step=step, start_s=start_s, end_s=end_s, entries=entries,
            num_padding_tokens=plan.num_padding_tokens, num_idle_rows=plan.num_idle_rows,
            num_kv_slots_used=scheduler.num_kv_slots_used, num_kv_slots_reserved=scheduler.num_kv_slots_reserved,
            num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
            finished=[r.request_id for r in finished],
            block_tables={rid: old[rid] if old.get(rid) == t else t for rid, t in plan.block_tables.items()},
            preempted=list(plan.preempted), draft_time_s=draft_time_s, layout=plan.layout,
            num_blocks_swapped_out=len(plan.blocks_to_swap_out), num_blocks_swapped_in=len(plan.blocks_to_swap_in),
            num_blocks_copied=len(plan.blocks_to_copy), draft_forwards=tuple(result.draft_forwards),
            token_budget=None if math.isinf(plan.token_budget) else int(plan.token_budget),
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


# ------------------------------------------------- what a schedule trace says (metrics of the records)
def _num_busy_rows(record: StepRecord) -> int:
    return sum(e.phase != "padding" for e in record.entries)


def padding_waste_fraction(trace: list[StepRecord]) -> float:
    """Padding tokens / every token computed (padding included): prompt left-padding plus the
    rows of finished requests in a static batch. 0.0 for an empty trace."""
    padding = sum(r.num_padding_tokens for r in trace)
    computed = sum(r.num_scheduled_tokens for r in trace) + padding
    return padding / computed if computed else 0.0


def slot_utilization(trace: list[StepRecord]) -> float:
    """Busy batch rows / (busy + padding + idle rows), summed over steps. Padding rows are
    static batching's early-finished waste; idle rows are slots no request fills."""
    busy = sum(_num_busy_rows(r) for r in trace)
    total = sum(len(r.entries) + r.num_idle_rows for r in trace)
    return busy / total if total else 0.0


def mean_batch_size(trace: list[StepRecord]) -> float:
    """Mean number of requests computing tokens per step (padding rows not counted)."""
    return float(np.mean([_num_busy_rows(r) for r in trace])) if trace else 0.0


def kv_waste_fraction(trace: list[StepRecord]) -> float:
    """1 - KV slots used / KV slots reserved, summed over steps: slots reserved but not (yet)
    written, e.g. Orca's prompt + max_new_tokens reservation. Static batching reserves its whole padded
    (B, T) cache, so its padding counts here as waste too (and shows in padding_waste_fraction)."""
    reserved = sum(r.num_kv_slots_reserved for r in trace)
    return 1.0 - sum(r.num_kv_slots_used for r in trace) / reserved if reserved else 0.0


def utilization_formula(output_lens: list[int]) -> float:
    """The static batching formula: a batch runs max(output_len) generation steps and
    request i produces a token in output_len[i] of them, so utilization = avg_len / max_len."""
    if not output_lens or min(output_lens) < 1:
        raise ValueError(f"output_lens must be a non-empty list of lengths >= 1, got {output_lens}")
    return float(np.mean(output_lens)) / max(output_lens)


def measured_decode_utilization(trace: list[StepRecord]) -> float:
    """Batch rows that produced a token / (those + padding rows), over the whole trace.

    The step that finishes a prompt is the first *generation* step (it samples token 1), so a
    request's token-producing rows are its decode rows plus its last prefill row; that is why
    a single static batch measures exactly ``utilization_formula(output_lens)``. Idle slots
    are not counted (the formula is per formed batch); Orca has no padding rows, so 1.0.
    """
    entries = [e for record in trace for e in record.entries]
    num_padding = sum(e.phase == "padding" for e in entries)
    num_decode = sum(e.phase == "decode" for e in entries)
    # A prefill row produces a token unless the request's next row is another prefill chunk:
    # walk backwards, remembering each request's next phase.
    num_last_prefill, next_phase = 0, {}
    for e in reversed(entries):
        if e.phase == "prefill":
            num_last_prefill += next_phase.get(e.request_id) != "prefill"
        next_phase[e.request_id] = e.phase
    produced = num_decode + num_last_prefill
    return produced / (produced + num_padding) if produced + num_padding else 0.0
