"""Clocks: how long a step took.

* :class:`WallClock` measures real time (``torch.cuda.synchronize`` first on CUDA so queued
  kernels are counted). Idle gaps between arrivals are skipped instead of slept through: no
  work happens while the engine is idle, so the timeline is the one a sleeping server would see.
* :class:`SimClock` asks a :class:`CostModel` for the step time from token counts, so a
  notebook's timeline, TTFT and Gantt chart are identical on every machine while the real model
  still computes real tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minibatch.scheduler.base import SchedulerOutput


@dataclass(frozen=True)
class CostModel:
    """A simple step-time model (seconds):

        step_time_s = fixed_s + per_seq_s * batch_rows + per_token_s * num_tokens
                      + per_context_token_s * sum(context lengths)

    num_tokens counts every token the forward computes, padding included (a padded (B, T)
    batch pays for its padding); batch_rows is the number of sequences in the forward.
    The defaults are rough numbers for smollm2-135m on a 2-core CPU; a calibrated model fit
    from measured steps is a ``minibatch.sim.cost_model.Profile`` (``python -m minibatch calibrate``).
    """

    fixed_s: float = 0.030
    per_seq_s: float = 0.0005
    per_token_s: float = 0.0015
    per_context_token_s: float = 0.000002

    def forward_time_s(self, rows: int, num_tokens: int, context: int) -> float:
        """One forward over ``rows`` sequences, ``num_tokens`` tokens, ``context`` context tokens."""
        return self.fixed_s + self.per_seq_s * rows + self.per_token_s * num_tokens + self.per_context_token_s * context

    def step_time_s(self, out: SchedulerOutput) -> float:
        rows = out.scheduled + out.padded
        num_tokens = out.num_scheduled_tokens + out.num_padding_tokens
        context = sum(s.request.num_computed_tokens + s.num_new_tokens for s in rows)
        return self.forward_time_s(len(rows), num_tokens, context)


class WallClock:
    """Real elapsed time of each step.

    ``now_s`` is a timeline in seconds: the sum of measured step times (scheduling and the forward)
    plus the idle gaps skipped by ``advance_to``, i.e. the time a server that sleeps while idle
    would show.
    """

    kind = "wall"

    def __init__(self, device: str | torch.device = "cpu"):
        self.is_cuda = torch.device(device).type == "cuda"
        self.now_s = 0.0
        self._t0 = 0.0

    def _sync(self):
        if self.is_cuda:
            torch.cuda.synchronize()

    def start_step(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def end_step(self, out: SchedulerOutput) -> float:
        """Stop timing; advance now_s by the measured step time and return it (seconds)."""
        self._sync()
        dt = time.perf_counter() - self._t0
        self.now_s += dt
        return dt

    def advance_to(self, t_s: float) -> None:
        """Skip an idle gap (nothing to run until t_s)."""
        self.now_s = max(self.now_s, t_s)


# A small draft model's forward (speculative decoding) on the same 2-core CPU: rough numbers for
# smollm2-135m-draft (2 layers, hidden 256), which costs about a tenth of a target decode step.
DRAFT_COST_MODEL = CostModel(fixed_s=0.004, per_seq_s=0.0002, per_token_s=0.0002, per_context_token_s=0.0)


class SimClock(WallClock):
    """Deterministic clock: each step takes ``cost_model.step_time_s(out)`` seconds, plus
    ``draft_cost_model.forward_time_s`` for each draft forward of a speculative step (whose
    share is written to ``out.draft_time_s``)."""

    kind = "sim"

    def __init__(self, cost_model: CostModel | None = None, draft_cost_model: CostModel | None = None):
        super().__init__("cpu")
        self.cost_model = cost_model or CostModel()
        self.draft_cost_model = draft_cost_model or DRAFT_COST_MODEL

    def start_step(self) -> None:
        pass

    def end_step(self, out: SchedulerOutput) -> float:
        out.draft_time_s = sum(self.draft_cost_model.forward_time_s(*f) for f in out.draft_forwards)
        dt = self.cost_model.step_time_s(out) + out.draft_time_s
        self.now_s += dt
        return dt


def make_clock(kind: str, device: str | torch.device = "cpu", cost_model: CostModel | None = None):
    """``"wall"`` or ``"sim"``; anything else raises ValueError."""
    if kind == "wall":
        return WallClock(device)
    if kind == "sim":
        return SimClock(cost_model)
    raise ValueError(f"clock must be 'wall' or 'sim', got {kind!r}")
