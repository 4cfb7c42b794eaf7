"""Clocks: how long a step took.

* :class:`WallClock` measures real time (``torch.cuda.synchronize`` first on CUDA so queued
  kernels are counted). Idle gaps between arrivals are skipped instead of slept through: no
  work happens while the engine is idle, so the timeline is the one a sleeping server would see.
* :class:`SimClock` asks a :class:`CostModel` for the step time from token counts, so a
  notebook's timeline, TTFT and Gantt chart are identical on every machine while the real model
  still computes real tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from minibatch.checks import MAX_SECONDS, FieldTypeError, check_real, short_repr
from minibatch.scheduler.output import PADDED


@dataclass(frozen=True)
class StepShape:
    """What a step's time depends on (counts of tokens and pairs; ``minibatch.sim.cost_model``
    explains each): num_tokens (padding included), logits (positions whose logits are computed),
    prefill_rows and prefill_attention (rows of several new tokens: count, and new x context
    query-key pairs), decode_attention (single-token rows x the longest context), padded (a static
    (B, T) batch). rows and context (sequences in the forward, and their context lengths summed)
    are what the simple :class:`CostModel` reads; a calibrated Profile does not use them."""

    num_tokens: int
    logits: int
    prefill_rows: int = 0
    prefill_attention: int = 0
    decode_attention: int = 0
    padded: bool = False
    rows: int = 0
    context: int = 0

    @classmethod
    def of(cls, record) -> "StepShape":
        """The shape of a step from its :class:`~minibatch.engine.StepRecord` (the calibration fit reads it)."""
        return cls.of_entries(record.entries, record.num_padding_tokens, record.layout)

    @classmethod
    def of_entries(cls, entries, num_padding_tokens: int, layout: str) -> "StepShape":
        """The shape of a step from its rows (StepEntry), padding tokens and layout (the clock prices it)."""
        rows = [(e.num_new_tokens, e.num_computed_tokens,
                 (1 + e.num_spec_tokens) if e.sampled or e.phase == "padding" else 0) for e in entries]
        num_padding_rows = sum(e.phase == "padding" for e in entries)
        return shape_from_rows(rows, num_padding_tokens - num_padding_rows, layout == PADDED)

    @classmethod
    def from_sample(cls, sample: dict) -> "StepShape":
        """The shape stored in a calibration sample (a dict with the fields and more)."""
        return cls(**{k: sample[k] for k in cls.__dataclass_fields__ if k in sample})


def shape_from_rows(rows: Iterable[tuple[int, int, int]], num_padding_tokens: int = 0,
                    padded: bool = False) -> StepShape:
    """A step's shape from its rows.

    rows: one (num_new_tokens, num_computed_tokens before the step, num_logits) per batch row;
        num_logits is 0 for a prefill chunk that does not reach the prompt's end, 1 + k for a
        speculative verify.
    padded: static batching's (B, T) batch: logits on every row, and attention is one call over
        the padded rectangle (prefill_attention = B x T x T_ctx, decode_attention = B x T_ctx;
        no per-row calls).
    num_padding_tokens: tokens of a padded batch that belong to no request (left padding and
        finished rows); rows of finished members count 1 new token each and are in ``rows``.
    """
    rows = list(rows)
    real_tokens = sum(n for n, _, _ in rows)
    plain = dict(num_tokens=real_tokens + num_padding_tokens, rows=len(rows), context=sum(c + n for n, c, _ in rows))
    if padded:  # one (B, T) batch: one attention call over B x T queries x T_ctx keys, padding included
        t_new = max(n for n, _, _ in rows)
        t_ctx = max(c + n for n, c, _ in rows)
        return StepShape(logits=len(rows), prefill_attention=len(rows) * t_new * t_ctx if t_new > 1 else 0,
                         decode_attention=len(rows) * t_ctx if t_new == 1 else 0, padded=True, **plain)
    multi = [(n, c) for n, c, _ in rows if n > 1]
    single = [c for n, c, _ in rows if n == 1]
    return StepShape(logits=sum(g for _, _, g in rows), prefill_rows=len(multi),
                     prefill_attention=sum(n * (c + n) for n, c in multi),
                     decode_attention=len(single) * (max(single) + 1) if single else 0, **plain)


class StepCostModel(Protocol):
    """What a simulated clock asks a cost model (:class:`CostModel`, a calibrated
    ``minibatch.sim.cost_model.Profile``): a step's seconds from its shape, and one draft-model
    forward's seconds from (rows, tokens, context tokens)."""

    def step_time_s(self, shape: StepShape) -> float: ...

    def forward_time_s(self, rows: int, num_tokens: int, context: int) -> float: ...


@dataclass(frozen=True)
class CostModel:
    """A simple step-time model (seconds):

        step_time_s = fixed_s + per_seq_s * batch_rows + per_token_s * num_tokens
                      + per_context_token_s * sum(context lengths)

    num_tokens counts every token the forward computes, padding included (a padded (B, T)
    batch pays for its padding); batch_rows is the number of sequences in the forward.
    The defaults are rough numbers for smollm2-135m on a 2-core CPU; a calibrated model fit
    from measured steps is a ``minibatch.sim.cost_model.Profile`` (``python -m minibatch calibrate``).

    Raises:
        FieldTypeError: a coefficient that is not a real number (a bool or str included).
        ValueError: a coefficient that is negative, NaN, infinite or above ``MAX_SECONDS``.
    """

    fixed_s: float = 0.030
    per_seq_s: float = 0.0005
    per_token_s: float = 0.0015
    per_context_token_s: float = 0.000002

    def __post_init__(self):  # a negative or NaN cost would run the timeline backwards or stall it
        for name in ("fixed_s", "per_seq_s", "per_token_s", "per_context_token_s"):
            check_real(getattr(self, name), f"CostModel.{name} (seconds)", 0.0, MAX_SECONDS)

    def forward_time_s(self, rows: int, num_tokens: int, context: int) -> float:
        """One forward over ``rows`` sequences, ``num_tokens`` tokens, ``context`` context tokens."""
        return self.fixed_s + self.per_seq_s * rows + self.per_token_s * num_tokens + self.per_context_token_s * context

    def step_time_s(self, shape: StepShape) -> float:
        return self.forward_time_s(shape.rows, shape.num_tokens, shape.context)


class WallClock:
    """Real elapsed time of each step.

    ``now_s`` is a timeline in seconds: the sum of measured step times (scheduling and the forward)
    plus the idle gaps skipped by ``advance_to``, i.e. the time a server that sleeps while idle
    would show.
    """

    kind = "wall"

    def __init__(self, device: str | torch.device = "cpu"):
        self.is_cuda = torch.device(device).type == "cuda"
        self._now_s = 0.0
        self._t0 = 0.0

    @property
    def now_s(self) -> float:
        return self._now_s

    def _advance(self, dt_s: float) -> None:
        """Move the timeline on by ``dt_s`` seconds (a step's time, or an idle gap skipped)."""
        self._now_s += dt_s

    def _sync(self):
        if self.is_cuda:
            torch.cuda.synchronize()

    def start_step(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def end_step(self, shape: StepShape, draft_forwards=(), draft_time_s: float = 0.0) -> tuple[float, float]:
        """Stop timing; advance now_s by the measured step time. Returns (step seconds, of which
        drafting: the executor's measured ``draft_time_s``)."""
        self._sync()
        dt = time.perf_counter() - self._t0
        self._advance(dt)
        return dt, draft_time_s

    def advance_to(self, t_s: float) -> None:
        """Skip an idle gap (nothing to run until t_s)."""
        self._now_s = max(self._now_s, t_s)


class LiveClock(WallClock):
    """Real time for a live server: ``now_s`` is the seconds since the clock was made (requests
    arrive at the time they are submitted), a step is measured like :class:`WallClock`'s, and an
    idle gap is not skipped but waited out by the front end that feeds the engine."""

    kind = "live"

    def __init__(self, device: str | torch.device = "cpu"):
        super().__init__(device)
        self._origin = time.perf_counter()

    @property
    def now_s(self) -> float:
        return time.perf_counter() - self._origin

    def _advance(self, dt_s: float) -> None:
        pass  # real time moves by itself: a step's time has already passed

    def advance_to(self, t_s: float) -> None:
        pass  # an idle gap is waited out by the front end (it sleeps until work arrives)


# A small draft model's forward (speculative decoding) on the same 2-core CPU: rough numbers for
# smollm2-135m-draft (2 layers, hidden 256), which costs about a tenth of a target decode step.
DRAFT_COST_MODEL = CostModel(fixed_s=0.004, per_seq_s=0.0002, per_token_s=0.0002, per_context_token_s=0.0)


class SimClock(WallClock):
    """Deterministic clock: each step takes ``cost_model.step_time_s(StepShape.of(record))``
    seconds, plus ``draft_cost_model.forward_time_s`` for each of its draft forwards (speculative
    decoding). Both are :class:`StepCostModel`: a :class:`CostModel` or a calibrated Profile."""

    kind = "sim"

    def __init__(self, cost_model: StepCostModel | None = None, draft_cost_model: StepCostModel | None = None):
        """Raises TypeError: a cost model without ``step_time_s`` and ``forward_time_s`` (e.g. a number, a class)."""
        super().__init__("cpu")
        self.cost_model = cost_model or CostModel()
        self.draft_cost_model = draft_cost_model or DRAFT_COST_MODEL
        for name, model in (("cost_model", self.cost_model), ("draft_cost_model", self.draft_cost_model)):
            if isinstance(model, type) or not all(callable(getattr(model, m, None))
                                                   for m in ("step_time_s", "forward_time_s")):
                raise FieldTypeError(f"SimClock {name} must be a CostModel or a calibrated Profile (an object with "
                                     f"step_time_s and forward_time_s), got {short_repr(model)}")

    def start_step(self) -> None:
        pass

    def end_step(self, shape: StepShape, draft_forwards=(), draft_time_s: float = 0.0) -> tuple[float, float]:
        """Price the step of ``shape`` and its draft forwards ((rows, tokens, context tokens) each, as
        ``StepResult.draft_forwards``; the measured draft_time_s is not used): returns (step seconds, of which
        drafting) and advances now_s.

        Raises:
            ValueError: the cost model priced the step at a negative, infinite or NaN time."""
        draft_s = sum(self.draft_cost_model.forward_time_s(*f) for f in draft_forwards)
        dt = self.cost_model.step_time_s(shape) + draft_s
        if not 0.0 <= dt < math.inf:  # NaN too: a NaN timeline admits no arrival again (the run would never end)
            raise ValueError(f"the SimClock's cost model priced a step at {dt} s ({draft_s} s of drafting): a step "
                             f"takes a finite time >= 0 ({type(self.cost_model).__name__}, {shape})")
        self._advance(dt)
        return dt, draft_s


def make_clock(kind: str, device: str | torch.device = "cpu", cost_model: CostModel | None = None):
    """``"wall"`` or ``"sim"``; anything else raises ValueError."""
    if kind == "wall":
        return WallClock(device)
    if kind == "sim":
        return SimClock(cost_model)
    raise ValueError(f"clock must be 'wall' or 'sim', got {kind!r}")
