"""Static (request-level) batching: the baseline Orca argues against (Orca §3.1, "request-level scheduling").

A batch of up to ``batch_size`` waiting requests is formed once ``batch_size`` have arrived or
the oldest has waited ``max_wait_s``. The prompts are left-padded to the longest one and the
batch runs as a padded (B, T) tensor until *every* member finishes:

* a request that finishes early keeps its row and computes a padding token every step
  (early-finished waste);
* a request that arrives while a batch runs waits for the whole batch (late-joining waste);
* short prompts pay for the longest prompt's length (padding waste).

Utilization of a batch's decode rows is avg(output_len) / max(output_len).
"""

from __future__ import annotations

from minibatch.checks import check_real
from minibatch.request import Request, RequestStatus
from minibatch.scheduler.config import StaticConfig
from minibatch.scheduler.base import Scheduler, SchedulerOutput, StepResult
from minibatch.scheduler.output import ScheduledRequest
from minibatch.scheduler.output import PADDED


class StaticScheduler(Scheduler):
    """Request-level batching with padding.

    Args:
        batch_size: the most requests in one batch, >= 1.
        max_wait_s: form a partial batch once the oldest waiting request waited this long, >= 0.

    Raises:
        ValueError: batch_size < 1, or max_wait_s negative, infinite or NaN.
        FieldTypeError: max_wait_s is not a real number (a bool or str included).
    """

    name = "static"
    layout = PADDED
    config_cls = StaticConfig

    @classmethod
    def from_config(cls, config) -> "StaticScheduler":
        return cls(batch_size=config.batch_size, max_wait_s=config.max_wait_s)

    def __init__(self, batch_size: int = 8, max_wait_s: float = 1.0):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        check_real(max_wait_s, "max_wait_s", 0.0)  # finite: an infinite wait never starts a partial batch
        self.batch_size = batch_size
        self.max_wait_s = max_wait_s
        self.batch: list[Request] = []  # members in row order; == running plus finished members
        self.padded_len = 0  # current padded length T of the (B, T) batch

    def schedule(self, now_s: float) -> SchedulerOutput:
        if self.batch and not self.running:  # the whole batch is done: only now can the next one start
            self.batch = []
        if not self.batch:
            if not self.waiting:
                return SchedulerOutput()
            # first come, first served (the base class's FCFS key: arrival time, then the order added), so a request
            # added late with an earlier arrival time goes first
            self.waiting.sort(key=self.sort_key)
            wake_s = self.waiting[0].arrival_time_s + self.max_wait_s
            if len(self.waiting) < self.batch_size and now_s < wake_s:
                return SchedulerOutput(wake_time_s=wake_s)  # wait for a fuller batch
            return self._start_batch()
        rows = [ScheduledRequest(r, 1, "decode", i) for i, r in enumerate(self.batch)]
        padded = [s for s in rows if s.request.is_finished]
        return SchedulerOutput(
            scheduled=[s for s in rows if not s.request.is_finished],
            padded=padded,
            layout=PADDED,
            num_padding_tokens=len(padded),
            num_idle_rows=self.batch_size - len(self.batch),
        )

    def _start_batch(self) -> SchedulerOutput:
        self.batch, self.waiting = self.waiting[: self.batch_size], self.waiting[self.batch_size :]
        self.running = list(self.batch)
        for r in self.batch:
            r.status = RequestStatus.RUNNING
        self.padded_len = max(r.num_prompt_tokens for r in self.batch)
        return SchedulerOutput(
            scheduled=[ScheduledRequest(r, r.num_prompt_tokens, "prefill", i) for i, r in enumerate(self.batch)],
            layout=PADDED,
            new_batch=True,
            num_padding_tokens=sum(self.padded_len - r.num_prompt_tokens for r in self.batch),
            num_idle_rows=self.batch_size - len(self.batch),
        )

    def update(self, plan: SchedulerOutput, result: StepResult) -> list[Request]:
        finished = self.advance(plan, result)
        for r in finished:
            self.running.remove(r)
        self.padded_len += 1 if not plan.new_batch else 0
        return finished

    def kv_capacity_slots(self, max_model_len: int) -> int:
        """The padded batch's KV: batch_size rows of up to ``max_model_len`` slots."""
        return self.batch_size * max_model_len

    @property
    def num_kv_slots_used(self) -> int:
        """KV slots holding real tokens of the batch's members (finished members' too: their rows
        stay in the cache until the next batch replaces it)."""
        return sum(r.num_computed_tokens for r in self.batch)

    @property
    def num_kv_slots_reserved(self) -> int:
        """The padded (B, T) KV cache: every row holds T slots, padding included."""
        return len(self.batch) * self.padded_len
