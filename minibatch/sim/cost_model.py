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

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from minibatch.clock import StepShape
from minibatch.sim.profile_format import FEATURES, LAYOUTS, PROFILE_FORMAT, check_profile_data

KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def features(shape: StepShape) -> list[float]:
    """The shape's FEATURES, as floats (the linear part of the fit)."""
    return [float(getattr(shape, f)) for f in FEATURES]


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
        X = np.array([features(s) for s in shapes]).reshape(len(shapes), len(FEATURES))
        return hat_basis(n, self.knots) @ np.array(self.curve_s) + X @ np.array([self.coef_s[f] for f in FEATURES])


def fit_layout(shapes: list, times_s: list[float], smoothing: float = 0.3,
               weights: list[float] | None = None, knee: int = 16) -> LayoutModel:
    """Non-negative least squares on relative error (scipy.optimize.nnls).

    shapes: one StepShape per measured time, or a list of StepShapes whose times add up to it
    (a speculative step's several draft forwards, timed together).

    The curve has two parts. Up to ``knee`` tokens it is free but non-decreasing (its values at
    1, 2, 4, .. knee, with a light smoothness penalty; the first is at least 0.1% of the fastest
    step, so every knot is > 0 even where the features could carry the whole cost): the
    small-batch region, where a CPU jumps from a matrix-vector product to a matrix product and a
    GPU is memory-bound. A forward never gets cheaper by adding tokens. Beyond the knee it is
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
        return np.hstack([curve_basis(n), np.array([features(x) for x in g]).reshape(len(g), len(FEATURES))]).sum(0)

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
    # the small-batch values as a floor plus non-negative increments: values = T @ params
    T = np.eye(X.shape[1])
    T[:len(small), :len(small)] = np.tril(np.ones((len(small), len(small))))
    floor = 1e-3 * t.min()
    A = A @ T
    b = b - A[:, 0] * floor
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0  # a feature never seen (e.g. no prefill rows) keeps coefficient 0
    params, _ = nnls(A / scale, b, maxiter=50 * X.shape[1])
    params /= scale
    params[0] += floor
    theta = T @ params
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
    source: str | None = field(default=None, compare=False, repr=False)  # the file it was loaded from

    def predict(self, shapes: list[StepShape]) -> np.ndarray:
        """Step times (s) of shapes, each by its layout's model (packed if padded was not fit)."""
        out = np.zeros(len(shapes))
        for layout in LAYOUTS:
            idx = [i for i, s in enumerate(shapes) if s.padded == (layout == "padded")]
            if idx:
                m = self.layouts.get(layout) or self.layouts["packed"]
                out[idx] = m.predict([shapes[i] for i in idx])
        return out

    def step_time_s(self, shape: StepShape) -> float:
        return float(self.predict([shape])[0])

    @property
    def dtype(self) -> str:
        """The dtype it was measured in ("float32" for profiles that do not say: measured before bf16 existed)."""
        return self.meta.get("dtype", "float32")

    def forward_time_s(self, rows: int, num_tokens: int, context: int) -> float:
        """A draft forward of ``rows`` single-token rows reading ``context`` context tokens."""
        model = self.draft or self.layouts["packed"]
        shape = StepShape(num_tokens=num_tokens, logits=rows, decode_attention=context)
        return float(model.predict([shape])[0])

    def save(self, path: str | Path) -> Path:
        """Write strict JSON (format "minibatch-profile-v1"; NaN/inf -> null) atomically
        (:func:`minibatch.files.write_json`: a failed write keeps the old file); parent folders
        are made. Returns the path.

        Raises:
            ValueError: the profile is not one :meth:`load` accepts (nothing is written).
        """
        from minibatch.files import write_json

        data = {"format": PROFILE_FORMAT, "model": self.model,
                "layouts": {k: asdict(v) for k, v in self.layouts.items()},
                "draft": asdict(self.draft) if self.draft else None, **self.meta}
        check_profile_data(data, path)
        return write_json(path, data, indent=1)

    @property
    def vocab_size(self) -> int:
        """The model's vocab_size, recorded by calibrate (token ids of generated traces).

        Raises:
            ValueError: the profile has none (made before calibrate recorded it); names the file.
        """
        if "vocab_size" not in self.meta:
            raise ValueError(f"{self.source or 'profile'}: no 'vocab_size' key (a profile from an older version): "
                             f"re-run python -m minibatch calibrate, or add \"vocab_size\": <the model's "
                             f"config.vocab_size> to the file")
        return self.meta["vocab_size"]

    @property
    def max_model_len(self) -> int | None:
        """The model's context limit in tokens, recorded by calibrate; None for a profile made before it was."""
        return self.meta.get("max_model_len")

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a profile written by :meth:`save`, checking every key the simulator uses.

        Keys: format ("minibatch-profile-v1"), model (str), layouts ({"packed": ..., "padded": ...},
        packed required; each {knots, curve_s, coef_s}), draft (the same or null; optional); the
        rest is ``meta``, where vocab_size and max_model_len (ints >= 1), samples and draft_samples (the calibration
        steps --refit fits again) are checked when present.

        Raises:
            ValueError: the file is missing, not JSON, not an object, of another format version,
                or a key is missing or of the wrong type; the message names the file and the key
                and says what to do (re-run ``python -m minibatch calibrate``).
        """
        from minibatch.files import read_json

        data = read_json(path, what="profile")
        check_profile_data(data, path)
        data = dict(data)
        layouts = {k: LayoutModel(**v) for k, v in data.pop("layouts").items()}
        draft = data.pop("draft", None)
        del data["format"]
        return cls(model=data.pop("model"), layouts=layouts, draft=LayoutModel(**draft) if draft else None,
                   meta=data, source=str(path))


def relative_errors(predicted, measured) -> dict[str, float]:
    """Median and 90th-percentile |predicted - measured| / measured, and the error of the totals."""
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    rel = np.abs(p - m) / m
    return {"median": float(np.median(rel)), "p90": float(np.quantile(rel, 0.9)),
            "total": float(abs(p.sum() - m.sum()) / m.sum())}


def repeat_spread(shapes: list[StepShape], times_s: list[float]) -> dict:
    """How far steps of one shape (equal :func:`features` and layout) lie from their shape's median time: the
    machine's own noise while it was measured, which no cost model can fit away. A fit error well above it is the
    model's; one near it is the machine's.

    Returns {"median", "p90"} of |time - its shape's median| / that median over every step whose shape was measured
    at least twice, and "steps", how many those are (medians None when no shape repeats).
    """
    groups: dict[tuple, list[float]] = {}
    for shape, t in zip(shapes, times_s):
        groups.setdefault((shape.padded, *features(shape)), []).append(float(t))
    dev = [abs(t - m) / m for ts in groups.values() if len(ts) > 1 for m in [float(np.median(ts))] for t in ts]
    if not dev:
        return {"median": None, "p90": None, "steps": 0}
    return {"median": float(np.median(dev)), "p90": float(np.quantile(dev, 0.9)), "steps": len(dev)}
