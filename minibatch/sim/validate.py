"""Is the simulator right? Run the same trace measured and simulated, and compare.

For each policy: a real run (the model, a WallClock) and a simulated one (SimExecutor on the
calibrated SimClock) of the same requests. Reported per policy:

* the metrics of both runs (output throughput, TTFT p50, TPOT p50, E2E p50) and the relative
  error of the simulation, ``(simulated - measured) / measured``;
* ``replay_error``: the measured run's own steps priced by the profile, against their measured
  durations (sum over the run): the cost model's error alone, without any schedule divergence;
  ``replay_error_by_kind`` splits it into prefill-only, mixed and decode-only steps (TTFT p50
  follows the prefill and mixed steps' prices, throughput mostly the decodes');
* ``error_at_measured_speed``: the simulation again with every step priced ``1 / (1 + replay_error)``
  times the profile, i.e. on a machine exactly as fast as the measured run's: what remains is the
  error of the cost model's shape and of the schedule, without the machine's speed drift since
  calibration (a shared CPU's speed moves by several percent; throughput follows the step times
  about 1:1, TTFT p50 of a loaded trace of a few dozen requests by up to several times as much);
* ``mechanics_error``: the simulation with each step given its *measured* duration
  (:class:`MeasuredClock`): the engine, the scheduler and the clock's stamping (first tokens at the
  step's end, arrivals admitted between steps, idle gaps skipped) are the same code on both
  clocks, so this is ~0 (microsecond rounding) and every TTFT error is a step-time error;
* speculative decoding: the simulated executor accepts drafts with the per-position acceptance
  rates the real run measured (and, for n-gram lookup, finds drafts as often as it did).
"""

from __future__ import annotations

import dataclasses

from minibatch.clock import SimClock, StepCostModel, StepShape
from minibatch.policies import get_policy
from minibatch.sim.cost_model import Profile

METRICS = ("output_throughput_tok_s", "ttft_p50_s", "tpot_p50_s", "e2e_p50_s")


def measured_speculation(engine) -> tuple[list[float] | None, float]:
    """(per-position acceptance rates, proposal rate) of a real speculative run: the fraction of
    decode rows that verified drafts is the proposal rate (n-gram lookup may find none)."""
    stats = engine.executor.stats
    decode = [e for rec in engine.trace for e in rec.entries if e.phase == "decode"]
    proposal = sum(e.num_spec_tokens > 0 for e in decode) / len(decode) if decode else 1.0
    return list(stats.acceptance_rate_per_pos) or None, proposal


def compare_runs(measured: dict, simulated: dict) -> dict[str, float | None]:
    """Relative error (simulated - measured) / measured of each of METRICS (None if missing)."""
    return {m: (simulated[m] - measured[m]) / measured[m] if measured.get(m) and simulated.get(m) is not None else None
            for m in METRICS}


STEP_FIELDS = ("num_tokens", "logits", "prefill_rows", "prefill_attention", "decode_attention", "time_us")


def measure_policy(policy: str, cfg, runner, requests, draft_runner=None) -> dict:
    """The measured half: a real run's metrics, its steps (STEP_FIELDS rows, for replaying them
    on any profile) and, when speculating, its acceptance and proposal rates."""
    from minibatch.compare import make_compare_clock, run_policies

    r = run_policies(cfg, requests, runner, lambda: make_compare_clock(cfg, runner.device), draft_runner=draft_runner,
                     policies=(policy,))
    engine, measured = r[policy].engine, r[policy].summary.to_dict()
    padded = any(r.layout == "padded" for r in engine.trace)
    steps = [[getattr(StepShape.of(r), f) for f in STEP_FIELDS[:-1]] + [round(r.duration_s * 1e6)]
             for r in engine.trace]
    row = {"policy": policy, "padded": padded,
           "measured": {m: measured[m] for m in METRICS}
                       | {"num_steps": len(engine.trace), "duration_s": measured["duration_s"]},
           "steps": steps}
    if get_policy(policy).proposer:
        acceptance, proposal = measured_speculation(engine)
        row["acceptance_rate_per_pos"] = acceptance
        row["proposal_rate"] = round(proposal, 4)
    return row


STEP_KINDS = ("prefill", "mixed", "decode")


def step_kind(step) -> str:
    """"prefill" (only rows of several new tokens), "decode" (only single-token rows) or "mixed"
    (both) of a stored step (a STEP_FIELDS row); a padded batch's prefill step is a "prefill"."""
    _, _, prefill_rows, prefill_attention, decode_attention = step[:5]
    has_prefill = prefill_rows > 0 or prefill_attention > 0
    return ("mixed" if decode_attention > 0 else "prefill") if has_prefill else "decode"


def replay_by_kind(row: dict, profile, predicted=None) -> dict[str, float | None]:
    """(predicted - measured) / measured of the summed time of each STEP_KINDS kind of the
    measured steps of ``row`` (a :func:`measure_policy` row), priced by ``profile``; None for a
    kind the run has none of. ``predicted``: ``profile``'s seconds for each of the row's steps, where the
    caller has them already (else priced here)."""
    if predicted is None:
        shapes = [StepShape(*s[:-1], padded=row["padded"]) for s in row["steps"]]
        predicted = profile.predict(shapes) if shapes else []
    out = {}
    for kind in STEP_KINDS:
        idx = [i for i, s in enumerate(row["steps"]) if step_kind(s) == kind]
        measured = sum(row["steps"][i][-1] for i in idx) / 1e6
        out[kind] = float(sum(predicted[i] for i in idx) - measured) / measured if idx else None
    return out


@dataclasses.dataclass(frozen=True)
class ScaledCost:
    """``model``'s step and draft-forward times (seconds) times ``factor`` (> 0): the same profile
    on a machine 1 / factor times as fast."""

    model: StepCostModel
    factor: float

    def step_time_s(self, shape: StepShape) -> float:
        return self.model.step_time_s(shape) * self.factor

    def forward_time_s(self, rows: int, num_tokens: int, context: int) -> float:
        return self.model.forward_time_s(rows, num_tokens, context) * self.factor


def speed_factor(traces, profile: Profile) -> float:
    """How much slower this machine ran real steps than ``profile`` prices them: the summed measured duration of
    the StepRecords in ``traces`` (wall-clock runs of the real engine, an iterable of traces) over the same steps'
    summed predicted time. > 1: slower than the machine that calibrated the profile. ``ScaledCost(profile,
    factor)`` then prices steps at this machine's speed, a one-number calibration (a full one: ``calibrate``)."""
    records = [r for trace in traces for r in trace]
    predicted = float(profile.predict([StepShape.of(r) for r in records]).sum())
    return sum(r.duration_s for r in records) / predicted


class MeasuredClock(SimClock):
    """A simulated clock that gives step i the measured duration of step i of a real run (``steps``:
    STEP_FIELDS rows, time in microseconds; padded: the run's layout). ``diverged_at`` is the first
    step whose simulated shape differs from the measured one (None: the schedule is the measured
    one); from there on the durations no longer belong to the steps they are given to.

    Raises:
        ValueError: the simulation runs more steps than were measured.
    """

    def __init__(self, steps: list, padded: bool):
        super().__init__()
        self.steps, self.padded = steps, padded
        self.diverged_at: int | None = None
        self._next = 0

    def end_step(self, step_shape: StepShape, draft_forwards=(), draft_time_s: float = 0.0) -> tuple[float, float]:
        i = self._next
        if i >= len(self.steps):
            raise ValueError(f"steps: the simulation ran more steps than the {len(self.steps)} measured")
        shape = StepShape(*self.steps[i][:-1], padded=self.padded)
        if self.diverged_at is None and dataclasses.replace(step_shape, rows=0, context=0) != shape:
            self.diverged_at = i
        self._next += 1
        dt = self.steps[i][-1] / 1e6
        self._advance(dt)
        return dt, 0.0


def simulate_row(row: dict, cfg, requests, clock_factory):
    """``row``'s policy (a :func:`measure_policy` row: speculative ones accept drafts at its measured
    rates) on fresh copies of ``requests`` with the SimExecutor and ``clock_factory()``'s clock;
    returns the :class:`~minibatch.experiment.Run`."""
    from minibatch.compare import run_policies
    from minibatch.sim.simulator import sim_executor

    policy = row["policy"]
    ex = sim_executor(policy, row.get("acceptance_rate_per_pos"), cfg.seed, row.get("proposal_rate", 1.0))
    return run_policies(cfg, requests, ex, clock_factory, policies=(policy,))[policy]


def simulate_measured(row: dict, cfg, requests, profile: Profile) -> dict:
    """The simulated half, for a row of :func:`measure_policy`: the same requests on ``profile``'s
    clock; adds "simulated", "error", "replay_error" and "replay_error_by_kind", and
    "error_at_measured_speed" and "mechanics_error" (with "diverged_at_step") to a copy of the row
    (see the module docstring). The last two are None for spec policies (the simulated acceptance draws differ
    from the real ones, so the schedules do), and the replays too for a draft-model proposer (the records keep no
    draft forwards' shapes); an n-gram run's replay prices its target steps, which is all the simulator charges it
    (the n-gram lookup itself costs nothing on the simulated clock)."""
    proposer = get_policy(row["policy"]).proposer
    spec, draft = proposer is not None, proposer == "draft"
    sim = simulate_row(row, cfg, requests, lambda: SimClock(profile, profile))
    simulated = sim.summary.to_dict()
    shapes = [StepShape(*s[:-1], padded=row["padded"]) for s in row["steps"]]
    measured_busy = sum(s[-1] for s in row["steps"]) / 1e6
    predicted = profile.predict(shapes)
    replay = float(predicted.sum() - measured_busy) / measured_busy
    out = {**row, "simulated": {m: simulated[m] for m in METRICS} | {"num_steps": len(sim.engine.trace),
                                                                     "duration_s": simulated["duration_s"]},
           "error": compare_runs(row["measured"], simulated), "replay_error": None if draft else replay,
           "replay_error_by_kind": None if draft else replay_by_kind(row, profile, predicted),
           "error_at_measured_speed": None, "mechanics_error": None}
    if not spec:
        scaled = ScaledCost(profile, 1 / (1 + replay))
        at_speed = simulate_row(row, cfg, requests, lambda: SimClock(scaled, scaled)).summary.to_dict()
        out["error_at_measured_speed"] = compare_runs(row["measured"], at_speed)
        clock = MeasuredClock(row["steps"], row["padded"])
        replayed = simulate_row(row, cfg, requests, lambda: clock).summary.to_dict()
        out["mechanics_error"] = compare_runs(row["measured"], replayed) | {"diverged_at_step": clock.diverged_at}
    return out
