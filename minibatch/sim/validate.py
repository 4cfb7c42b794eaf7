"""Is the simulator right? Run the same trace measured and simulated, and compare.

For each policy: a real run (the model, a WallClock) and a simulated one (SimExecutor on the
calibrated SimClock) of the same requests. Reported per policy:

* the metrics of both runs (output throughput, TTFT p50, TPOT p50, E2E p50) and the relative
  error of the simulation, ``(simulated - measured) / measured``;
* ``replay_error``: the measured run's own steps priced by the profile, against their measured
  durations (sum over the run): the cost model's error alone, without any schedule divergence;
* speculative decoding: the simulated executor accepts drafts with the per-position acceptance
  rates the real run measured (and, for n-gram lookup, finds drafts as often as it did).
"""

from __future__ import annotations

import dataclasses

from minibatch.clock import StepShape
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

    one = dataclasses.replace(cfg, policies=(policy,))
    r = run_policies(one, requests, runner, lambda: make_compare_clock(cfg, runner.device), draft_runner=draft_runner)
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


def simulate_measured(row: dict, cfg, requests, profile: Profile) -> dict:
    """The simulated half, for a row of :func:`measure_policy`: the same requests on ``profile``'s
    clock; adds "simulated", "error" and "replay_error" (None for spec policies: the records keep
    no draft forwards' shapes, see the end-to-end error) to a copy of the row."""
    from minibatch.sim.simulator import simulate_policies

    policy = row["policy"]
    sim = simulate_policies(dataclasses.replace(cfg, policies=(policy,)), profile, requests,
                            row.get("acceptance_rate_per_pos"), row.get("proposal_rate", 1.0))[policy]
    sengine, simulated = sim.engine, sim.summary.to_dict()
    shapes = [StepShape(*s[:-1], padded=row["padded"]) for s in row["steps"]]
    measured_busy = sum(s[-1] for s in row["steps"]) / 1e6
    replay = float(profile.predict(shapes).sum() - measured_busy) / measured_busy
    return {**row, "simulated": {m: simulated[m] for m in METRICS} | {"num_steps": len(sengine.trace),
                                                                      "duration_s": simulated["duration_s"]},
            "error": compare_runs(row["measured"], simulated),
            "replay_error": None if get_policy(policy).proposer else replay}


def validate_policy(policy: str, cfg, runner, requests, profile: Profile, draft_runner=None) -> dict:
    """Measured vs simulated for one policy on ``requests`` (see the module docstring)."""
    return simulate_measured(measure_policy(policy, cfg, runner, requests, draft_runner), cfg, requests, profile)
