"""Notebook 07 (scale experiments in simulation) and ``benchmarks/sim_scale.py``: tables, glue, the
exercise checks.

The simulator (``minibatch.sim``) runs our real schedulers on a calibrated clock, so thousands
of requests take seconds. The experiments (rate sweeps, the offline table, capacity at a latency
bound interpolated between swept rates, an analytical roofline profile) are
``minibatch.experiments.rate_sweep``, the figures ``minibatch.viz.simulation``. Here: the papers'
headline claims (CLAIM_IDS, from ``minibatch.claims``), the calibrated clock checked (:func:`profile_samples`,
:func:`plot_cost_model`, :func:`print_validation`) and the exercise checks (:func:`check_best_batch`,
:func:`check_static_break_rate`).
"""

from __future__ import annotations

import numpy as np

from minibatch.experiments.rate_sweep import DEFAULT_SETUPS, rate_sweep
from minibatch.lessons import exercise
from minibatch.sim.cost_model import Profile, StepShape
from minibatch.viz.simulation import plot_calibration

# The published numbers section 6 puts beside ours (minibatch.claims): the often-quoted static-vs-continuous
# table with its real source, the Anyscale post's headline, and Orca's and vLLM's headline claims.
CLAIM_IDS = ("cann-static-vs-continuous", "anyscale-continuous", "orca-throughput", "vllm-throughput")


# ---------------------------------------------------------------------- the calibrated clock, checked
def profile_samples(profile: Profile, layout: str = "packed") -> tuple[list[dict], np.ndarray]:
    """The calibration samples of one layout and the profile's predicted times for them (s)."""
    rows = [s for s in profile.meta.get("samples", []) if s["layout"] == layout]
    shapes = [StepShape.from_sample(s) for s in rows]
    return rows, profile.predict(shapes) if rows else np.zeros(0)


def plot_cost_model(profile: Profile, axes=None):
    """Left: measured vs predicted step time of every calibration step of ``profile`` (both layouts;
    the band is +-15%). Right: packed steps' time against num_tokens, with the fitted curve(N).
    Returns the two Axes."""
    samples = {layout: profile_samples(profile, layout) for layout in ("packed", "padded")}
    return plot_calibration(samples, profile.layouts["packed"], axes)


def print_validation(report: dict) -> None:
    """The validation report (benchmarks/validate_sim.py's JSON) as a table: measured, simulated
    and the error for output throughput and TTFT p50; "rerun" is the difference of an earlier
    measurement of the same run (the noise floor), "replay" the cost model alone."""
    print(f"{'trace':<26}{'policy':<14}{'out tok/s':>10}{'sim':>7}{'error':>8}{'rerun':>7}{'TTFT p50 s':>11}{'sim':>7}"
          f"{'error':>8}{'rerun':>7}{'replay':>8}")
    for name, t in report["traces"].items():
        for r in t["policies"]:
            m, s, e = r["measured"], r["simulated"], r["error"]
            rep = r.get("repeat_error") or {}
            fmt = lambda x: "-" if x is None else f"{x:+.0%}"  # noqa: E731
            print(f"{name:<26}{r['policy']:<14}{m['output_throughput_tok_s']:>10.2f}{s['output_throughput_tok_s']:>7.2f}"
                  f"{e['output_throughput_tok_s']:>+8.1%}{fmt(rep.get('output_throughput_tok_s')):>7}"
                  f"{m['ttft_p50_s']:>11.3f}{s['ttft_p50_s']:>7.3f}{e['ttft_p50_s']:>+8.1%}"
                  f"{fmt(rep.get('ttft_p50_s')):>7}{fmt(r['replay_error']):>8}")


@exercise.check(hint="a decode step of b requests makes b tokens in its predicted time: compare b / time over 1..64")
def check_best_batch(fn, profile: Profile, context: int = 200, max_batch: int = 64) -> str:
    """The exercise check: ``fn(profile)`` must return a decode batch size in 1..max_batch with the most
    tokens per second on ``profile``'s clock, at ``context`` tokens of context per request. Prints one line
    (``exercise.check``); returns whether it was right.

    Raises (reported as "not yet"):
        AssertionError: a size outside 1..max_batch, or one with fewer tokens per second than another.
    """
    best = exercise.require(fn(profile), "best_batch(profile)")
    sizes = range(1, max_batch + 1)
    times = profile.predict([StepShape(num_tokens=b, logits=b, decode_attention=b * context) for b in sizes])
    tok_s = {b: b / t for b, t in zip(sizes, times)}
    assert best in tok_s, f"a batch size in 1..{max_batch} is needed, got {best!r}"
    assert tok_s[best] >= max(tok_s.values()) * (1 - 1e-9), (f"batch {best} decodes {tok_s[best]:.0f} tokens/s; "
                                                             f"another size in 1..{max_batch} decodes more")
    return f"best decode batch on this CPU: {best} ({tok_s[best]:.0f} tokens/s vs {tok_s[1]:.0f} at batch 1)"


@exercise.check(hint="a queue stays short while requests arrive slower than they are served: section 6's offline "
                     "row gives the most requests per second static bs=8 serves")
def check_static_break_rate(prediction, profile: Profile, rates=(0.15, 0.2, 0.25, 0.3, 0.35), slo_s: float = 40.0,
                            num_requests: int = 200, seed: int = 11) -> str:
    """Check a predicted rate: the lowest of ``rates`` (requests/s) at which static batching (bs=8) on
    ``profile``'s clock has a TTFT p99 over ``slo_s`` seconds, on ``num_requests`` requests of section 4's
    lengths. Prints one line (``exercise.check``); returns whether it was right.

    Raises (reported as "not yet"):
        AssertionError: a rate not in ``rates``, or not the lowest one that breaks the SLO.
    """
    from minibatch.workload import make_trace

    prediction = exercise.require(prediction, "my_prediction")
    assert prediction in rates, f"choose one of the rates {list(rates)}, not {prediction!r}"

    def trace_fn(rate: float) -> list:
        return make_trace(num_requests, rate_per_s=rate, max_prompt_len=256, max_output_len=256, output_scale=0.25,
                          seed=seed)

    rows = rate_sweep(profile, trace_fn, rates, {"static bs=8": DEFAULT_SETUPS["static bs=8"]}, n_slots=32 * 512)
    p99 = {r["rate"]: r["ttft_p99_s"] for r in rows}
    first = min((r for r in rates if p99[r] > slo_s), default=None)
    mine = f"at {prediction:g} requests/s TTFT p99 is {p99[prediction]:.1f} s"
    assert first is not None and prediction >= first, f"{mine}, within the {slo_s:g} s SLO"
    assert prediction == first, f"{mine}, over the SLO, but a lower rate already breaks it"
    below = max((r for r in rates if r < first), default=None)
    before = f" (at {below:g} requests/s: {p99[below]:.1f} s)" if below is not None else ""
    return f"static bs=8 breaks the {slo_s:g} s TTFT p99 SLO at {first:g} requests/s: {p99[first]:.1f} s{before}"
