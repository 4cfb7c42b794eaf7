"""Notebook 07 (scale experiments in simulation) and ``benchmarks/sim_scale.py``: tables, glue, the
exercise's answer.

The simulator (``minibatch.sim``) runs our real schedulers on a calibrated clock, so thousands
of requests take seconds. The experiments (rate sweeps, the offline table, capacity at a latency
bound, an analytical roofline profile) are ``minibatch.experiments.rate_sweep``, the figures
``minibatch.viz.simulation``. Here: the papers' headline claims (CLAIMS), the calibrated clock
checked (:func:`profile_samples`, :func:`plot_cost_model`, :func:`print_validation`) and
:func:`best_decode_batch`.
"""

from __future__ import annotations

import numpy as np

from minibatch.experiments.rate_sweep import DEFAULT_SETUPS, capacity_at, offline_table, rate_sweep  # noqa: F401
from minibatch.experiments.rate_sweep import roofline_profile, summary_row  # noqa: F401
from minibatch.sim.cost_model import Profile, StepShape
from minibatch.viz.simulation import plot_calibration, plot_rate_sweep, plot_validation  # noqa: F401

CLAIMS = {
    "quoted_table": "static batching bs=64: 44.2 req/s vs continuous batching: 482 req/s (10.9x), "
                  "the often-quoted table; its model, hardware and trace are not stated there",
    "orca": "Orca (OSDI'22 §6.2): 36.9x the throughput of NVIDIA FasterTransformer (request-level "
            "batching) at the same latency, GPT-3 175B on 16 A100s, synthetic trace",
    "vllm": "vLLM (SOSP'23 §6.2): 2-4x the throughput of Orca and FasterTransformer at the same "
            "normalized latency, OPT-13B..175B on A100s, ShareGPT and Alpaca traces",
}


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


def best_decode_batch(profile: Profile, context: int = 200, max_batch: int = 64) -> int:
    """The exercise's answer: the decode batch size in 1..max_batch with the most predicted
    tokens per second at ``context`` tokens of context per request."""
    sizes = np.arange(1, max_batch + 1)
    times = profile.predict([StepShape(num_tokens=int(b), logits=int(b),
                                       decode_attention=int(b) * context) for b in sizes])
    return int(sizes[np.argmax(sizes / times)])
