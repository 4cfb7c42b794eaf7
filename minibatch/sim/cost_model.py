"""A step-time model fit from measured steps: the calibrated clock of the simulator.

Vidur (Agrawal et al., MLSys'24) §4: profile the model's operators on the target machine, fit a
model of a step's time from what the batch contains, then run the *real* scheduler against that
model instead of the GPU. We do the same at the granularity of one engine step: the engine's own
step records (measured with a WallClock) are the samples, so the fit includes what a real step
pays besides the forward (scheduling, building the batch, sampling).

A step's shape (:class:`StepShape`) is what the cost depends on:

* ``num_tokens`` N: every token the forward computes (padding included). The linear layers'
  cost is a *piecewise-linear curve* in N, not a line: on a CPU a 1-token decode is a memory-bound
  matrix-vector product, 2..16 tokens cost about the same compute-bound matrix product, and only
  beyond that the cost grows with N (on a GPU the flat part reaches hundreds of tokens: the
  roofline's memory-bound region). The curve's values at knots 1, 2, 4, ... are fit.
* ``logits``: positions whose logits are computed (one per sampling row, 1 + k for a speculative
  verify, every row of a padded batch): the LM head and the sampler.
* ``prefill_rows``, ``prefill_attention``: rows with several new tokens are one attention call
  each (a per-call overhead) over new x (cached + new) query-key pairs.
* ``decode_attention``: single-token rows attend in one padded call: rows x longest context.

    step_time_s = curve(N) + c_logits * logits + c_prefill_rows * prefill_rows
                  + c_prefill_attention * prefill_attention + c_decode_attention * decode_attention

Coefficients are fit by non-negative least squares on *relative* error (every step counts the
same, short decodes as much as long prefills), one set per layout: ``packed`` (selective batching,
the paged KV cache) and ``padded`` (static batching's (B, T) batch).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from minibatch.scheduler.base import SchedulerOutput

FEATURES = ("logits", "prefill_rows", "prefill_attention", "decode_attention")
LAYOUTS = ("packed", "padded")
KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PROFILE_FORMAT = "minibatch-profile-v1"


@dataclass(frozen=True)
class StepShape:
    """What a step's time depends on (all counts; see the module docstring)."""

    num_tokens: int
    logits: int
    prefill_rows: int = 0
    prefill_attention: int = 0
    decode_attention: int = 0
    padded: bool = False

    def features(self) -> list[float]:
        return [float(getattr(self, f)) for f in FEATURES]

    @classmethod
    def from_sample(cls, sample: dict) -> "StepShape":
        """The shape stored in a calibration sample (a dict with the fields and more)."""
        return cls(**{k: sample[k] for k in cls.__dataclass_fields__})


def shape_from_rows(rows: Iterable[tuple[int, int, int]], num_padding_tokens: int = 0, padded: bool = False) -> StepShape:
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
    if padded:  # one (B, T) batch: one attention call over B x T queries x T_ctx keys, padding included
        t_new = max(n for n, _, _ in rows)
        t_ctx = max(c + n for n, c, _ in rows)
        return StepShape(num_tokens=real_tokens + num_padding_tokens, logits=len(rows),
                         prefill_attention=len(rows) * t_new * t_ctx if t_new > 1 else 0,
                         decode_attention=len(rows) * t_ctx if t_new == 1 else 0, padded=True)
    multi = [(n, c) for n, c, _ in rows if n > 1]
    single = [c for n, c, _ in rows if n == 1]
    return StepShape(
        num_tokens=real_tokens + num_padding_tokens,
        logits=sum(g for _, _, g in rows),
        prefill_rows=len(multi),
        prefill_attention=sum(n * (c + n) for n, c in multi),
        decode_attention=len(single) * (max(single) + 1) if single else 0,
    )


def shape_of_output(out: SchedulerOutput) -> StepShape:
    """The shape of a planned step (before the scheduler's update, as the clock sees it)."""
    rows = []
    for s in out.scheduled:
        r = s.request
        reaches_end = r.num_computed_tokens + s.num_new_tokens >= r.num_tokens
        rows.append((s.num_new_tokens, r.num_computed_tokens, (1 + len(s.spec_token_ids)) if reaches_end else 0))
    rows += [(1, s.request.num_computed_tokens, 1) for s in out.padded]
    # A padded batch's padding tokens: the scheduler counts finished rows there too (one each).
    return shape_from_rows(rows, out.num_padding_tokens - len(out.padded), out.is_padded_batch)


def shape_of_record(record, padded: bool = False) -> StepShape:
    """The shape of a recorded step (a StepRecord of ``engine.trace``); padded: it ran as a
    static (B, T) batch (the record does not say; the caller knows the policy)."""
    rows = [(e.num_new_tokens, e.num_computed_tokens,
             (1 + e.num_spec_tokens) if e.sampled or e.phase == "padding" else 0) for e in record.entries]
    num_padding_rows = sum(e.phase == "padding" for e in record.entries)
    return shape_from_rows(rows, record.num_padding_tokens - num_padding_rows, padded)


def hat_basis(num_tokens: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """(len(num_tokens), len(knots)) weights of linear interpolation between knots, so that
    basis @ values = the piecewise-linear curve through (knots, values); beyond the last knot the
    last segment is extended (extrapolated linearly)."""
    x = np.asarray(num_tokens, dtype=float)
    k = np.asarray(knots, dtype=float)
    B = np.zeros((len(x), len(k)))
    j = np.clip(np.searchsorted(k, x, side="right") - 1, 0, len(k) - 2)
    w = (x - k[j]) / (k[j + 1] - k[j])  # > 1 beyond the last knot: linear extrapolation
    rows = np.arange(len(x))
    B[rows, j] = 1 - w
    B[rows, j + 1] = w
    return B


@dataclass
class LayoutModel:
    """The fitted model of one layout: curve values (s) at ``knots`` (tokens) and one coefficient
    (s per unit) per name in FEATURES."""

    knots: list[int]
    curve_s: list[float]
    coef_s: dict[str, float]

    def predict(self, shapes: list[StepShape]) -> np.ndarray:
        """Step times in seconds, (len(shapes),)."""
        n = np.array([s.num_tokens for s in shapes])
        X = np.array([s.features() for s in shapes]).reshape(len(shapes), len(FEATURES))
        return hat_basis(n, self.knots) @ np.array(self.curve_s) + X @ np.array([self.coef_s[f] for f in FEATURES])


def fit_layout(shapes: list, times_s: list[float], smoothing: float = 0.3,
               weights: list[float] | None = None, knee: int = 16) -> LayoutModel:
    """Non-negative least squares on relative error (scipy.optimize.nnls).

    shapes: one StepShape per measured time, or a list of StepShapes whose times add up to it
    (a speculative step's several draft forwards, timed together).

    The curve has two parts. Up to ``knee`` tokens it is free (its values at 1, 2, 4, .. knee,
    each >= 0, with a light smoothness penalty): the small-batch region, where a CPU jumps from a
    matrix-vector product to a matrix product and a GPU is memory-bound. Beyond the knee it is
    the knee's value plus hinges sum_j beta_j * max(N - k_j, 0) with beta_j >= 0 at the knots
    k_j >= knee: compute-bound, so the cost per extra token never decreases (convex). Without
    that constraint a few large prefills let the fit bend the curve down and hand their cost to
    the attention terms. Knots run up to the first one >= the largest N measured.

    weights: per-sample weight of its squared relative error (default 1 each); calibration
    gives each workload the same total weight, so a few big prefills count as much as hundreds
    of decodes.

    Raises:
        ValueError: fewer samples than parameters, or a time <= 0.
    """
    from scipy.optimize import nnls

    t = np.asarray(times_s, dtype=float)
    if (t <= 0).any():
        raise ValueError("step times must be > 0 seconds")
    groups = [s if isinstance(s, (list, tuple)) else [s] for s in shapes]
    n_max = max(x.num_tokens for g in groups for x in g)
    top = next(k for k in KNOTS if k >= n_max) if n_max <= KNOTS[-1] else KNOTS[-1]
    knots = [k for k in KNOTS if k <= max(top, 2)]
    small = [k for k in knots if k <= knee] or knots[:2]
    hinges = [k for k in knots if k >= small[-1] and k < knots[-1]]

    def curve_basis(x):
        return np.hstack([hat_basis(np.minimum(x, small[-1]), small),  # flat beyond the knee ...
                          np.maximum(np.asarray(x, float)[:, None] - np.array(hinges, float), 0.0)])  # ... plus hinges

    def design(g):
        n = np.array([x.num_tokens for x in g], dtype=float)
        return np.hstack([curve_basis(n), np.array([x.features() for x in g]).reshape(len(g), len(FEATURES))]).sum(0)

    X = np.array([design(g) for g in groups])
    if len(t) < X.shape[1]:
        raise ValueError(f"need at least {X.shape[1]} measured steps to fit, got {len(t)}")
    w = np.sqrt(np.asarray(weights, dtype=float) / np.mean(weights)) if weights is not None else np.ones_like(t)
    A, b = X / t[:, None] * w[:, None], w
    # smoothness: second differences of the small-batch values, weighted like `smoothing` samples
    penalty = np.zeros((max(len(small) - 2, 0), X.shape[1]))
    for j in range(len(small) - 2):
        penalty[j, j:j + 3] = np.array([1.0, -2.0, 1.0]) * smoothing / np.median(t)
    A, b = np.vstack([A, penalty]), np.concatenate([b, np.zeros(len(penalty))])
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0  # a feature never seen (e.g. no prefill rows) keeps coefficient 0
    theta, _ = nnls(A / scale, b, maxiter=50 * X.shape[1])
    theta /= scale
    k_curve = len(small) + len(hinges)
    curve = curve_basis(np.array(knots, dtype=float)) @ theta[:k_curve]  # exact: kinks only at knots
    return LayoutModel(knots=knots, curve_s=curve.tolist(), coef_s=dict(zip(FEATURES, theta[k_curve:].tolist())))


@dataclass
class Profile:
    """A calibrated cost model for one model on one machine: a :class:`LayoutModel` per layout,
    optionally a draft model's (speculative decoding), and the samples it was fit on.

    It is a clock's cost model: ``step_time_s(out)`` for a planned step and
    ``forward_time_s(rows, num_tokens, context)`` for a draft forward (SimClock's interface).
    """

    model: str
    layouts: dict[str, LayoutModel]
    draft: LayoutModel | None = None
    meta: dict = field(default_factory=dict)  # command, environment, fit errors, samples

    def predict(self, shapes: list[StepShape]) -> np.ndarray:
        """Step times (s) of shapes, each by its layout's model (packed if padded was not fit)."""
        out = np.zeros(len(shapes))
        for layout in LAYOUTS:
            idx = [i for i, s in enumerate(shapes) if s.padded == (layout == "padded")]
            if idx:
                m = self.layouts.get(layout) or self.layouts["packed"]
                out[idx] = m.predict([shapes[i] for i in idx])
        return out

    def step_time_s(self, out: SchedulerOutput) -> float:
        return float(self.predict([shape_of_output(out)])[0])

    def forward_time_s(self, rows: int, num_tokens: int, context: int) -> float:
        """A draft forward of ``rows`` single-token rows reading ``context`` context tokens."""
        model = self.draft or self.layouts["packed"]
        shape = StepShape(num_tokens=num_tokens, logits=rows, decode_attention=context)
        return float(model.predict([shape])[0])

    def save(self, path: str | Path) -> Path:
        """Write JSON (format "minibatch-profile-v1"); parent folders are made."""
        data = {"format": PROFILE_FORMAT, "model": self.model,
                "layouts": {k: asdict(v) for k, v in self.layouts.items()},
                "draft": asdict(self.draft) if self.draft else None, **self.meta}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a profile written by :meth:`save`.

        Raises:
            FileNotFoundError: no such file. ValueError: not a profile (names the format found).
        """
        data = json.loads(Path(path).read_text())
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{path}: format must be {PROFILE_FORMAT!r}, got {data.get('format')!r}")
        layouts = {k: LayoutModel(**v) for k, v in data.pop("layouts").items()}
        draft = LayoutModel(**data.pop("draft")) if data.get("draft") else None
        data.pop("draft", None)
        data.pop("format")
        return cls(model=data.pop("model"), layouts=layouts, draft=draft, meta=data)


def relative_errors(predicted, measured) -> dict[str, float]:
    """Median and 90th-percentile |predicted - measured| / measured, and the error of the totals."""
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    rel = np.abs(p - m) / m
    return {"median": float(np.median(rel)), "p90": float(np.quantile(rel, 0.9)),
            "total": float(abs(p.sum() - m.sum()) / m.sum())}
