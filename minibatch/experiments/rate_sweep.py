"""Scale experiments in simulation (notebook 07, ``benchmarks/sim_scale.py``): request rate against
throughput and tail latency.

The simulator (``minibatch.sim``) runs our real schedulers on a calibrated clock, so thousands of
requests take seconds. Each setup is a policy row and its options, run through
``minibatch.experiment.run`` on a SimExecutor and a SimClock pricing steps with a Profile:

* :func:`rate_sweep`: the throughput-latency curves of Orca §6 and vLLM §6 (static batching at
  several batch sizes and the continuous policies);
* :func:`offline_table`: every request at t = 0, the most requests per second each setup serves;
* :func:`capacity_at`: the highest rate whose latency stays under a bound (how Orca and vLLM state
  their "x times the throughput at the same latency"); :func:`capacity_is_lower_bound` when it never crossed it;
* :func:`roofline_profile`: an *analytical* profile of a GPU (step time = max(bytes moved /
  bandwidth, FLOPs / peak) + overhead): a what-if, never a measurement, labelled so wherever used.

Rows are plain JSON-ready dicts; rates are requests/s, times seconds.
"""

from __future__ import annotations

import numpy as np

from minibatch.clock import SimClock
from minibatch.experiment import Run, run
from minibatch.request import Request
from minibatch.roofline import H100_SXM, roofline_step_s
from minibatch.sim.cost_model import FEATURES, LayoutModel, Profile
from minibatch.sim.executor import SimExecutor

# Setups: name -> (policy-table row, its options). Static batching is request-level batching
# (FasterTransformer's); orca reserves prompt + max_new_tokens per request ("Orca (Max)" when the
# reservation is the server's length limit); paged and chunked allocate blocks on demand.
DEFAULT_SETUPS = {
    "static bs=8": ("static", dict(batch_size=8)),
    "static bs=32": ("static", dict(batch_size=32)),
    "static bs=64": ("static", dict(batch_size=64)),
    "orca": ("orca", {}),
    "paged": ("paged", {}),
    "chunked": ("chunked", dict(max_num_batched_tokens=512)),
}
# Engine options of every setup unless the caller's or the setup's own say otherwise
ENGINE_DEFAULTS = {"max_num_seqs": 256, "n_slots": 65536, "max_wait_s": 0.5}
# The columns of :func:`summary_row`, in order (``Run.row`` fields and the sweep's own)
FIELDS = ("setup", "rate", "num_requests", "request_throughput_req_s", "output_throughput_tok_s", "ttft_p50_s",
          "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "tpot_p50_s", "normalized_latency_s", "mean_batch_size",
          "num_preemptions", "num_steps")


def summary_row(result: Run, name: str, rate: float | None) -> dict:
    """One row of a sweep or table: ``result.row`` of FIELDS, the setup ``name`` and the rate (requests/s).
    normalized_latency_s is vLLM's normalized latency: mean over requests of end-to-end latency / output length."""
    e2e_per_token = [(r.finish_time_s - r.arrival_time_s) / r.num_output_tokens for r in result.requests]
    return result.row(*FIELDS, setup=name, rate=rate, normalized_latency_s=float(np.mean(e2e_per_token)))


def setup_rows(profile: Profile, requests: list[Request], rate: float | None, setups: dict | None = None,
               **engine_kwargs) -> list[dict]:
    """:func:`summary_row` of each setup (default DEFAULT_SETUPS) run on ``requests`` with a SimExecutor and
    ``profile``'s clock; engine options: ENGINE_DEFAULTS, then ``engine_kwargs``, then the setup's own."""
    rows = []
    for name, (policy, kwargs) in (setups or DEFAULT_SETUPS).items():
        result = run(policy, requests, SimExecutor(), SimClock(profile, profile),
                     config={**ENGINE_DEFAULTS, **engine_kwargs}, **kwargs)  # each policy takes the settings it has
        rows.append(summary_row(result, name, rate))
    return rows


def rate_sweep(profile: Profile, trace_fn, rates, setups: dict | None = None, **engine_kwargs) -> list[dict]:
    """For each rate (requests/s) and setup: ``trace_fn(rate)`` (a list of requests) through the
    setup on the simulated clock. Rows (:func:`summary_row`): setup, rate, throughputs, TTFT / E2E p50
    and p99, normalized latency (s per output token), mean batch size, preemptions."""
    return [row for rate in rates for row in setup_rows(profile, trace_fn(rate), rate, setups, **engine_kwargs)]


def offline_table(profile: Profile, requests: list[Request], setups: dict | None = None, **engine_kwargs) -> list[dict]:
    """Every request at t = 0 (arrivals ignored): each setup's request and output throughput."""
    at_zero = [Request(r.request_id, r.prompt_token_ids, r.max_new_tokens, r.sampling) for r in requests]
    return setup_rows(profile, at_zero, None, setups, **engine_kwargs)


def capacity_at(rows: list[dict], setup: str, key: str = "normalized_latency_s", limit: float = 1.0) -> float | None:
    """The rate (requests/s) at which ``setup``'s ``key`` reaches ``limit``: linear interpolation of ``key``
    between the last swept rate under the bound (it and every lower rate <= ``limit``) and the first over it,
    so the estimate does not jump from one grid point to the next. None: not even the lowest rate is under;
    the highest swept rate when no rate is over (a lower bound: the sweep stopped first)."""
    best = None
    for r in sorted((r for r in rows if r["setup"] == setup), key=lambda r: r["rate"]):
        if r[key] is None or r[key] > limit:
            if best is None or r[key] is None:
                return best
            (r0, y0), (r1, y1) = best, (r["rate"], r[key])
            return r0 + (r1 - r0) * (limit - y0) / (y1 - y0)
        best = (r["rate"], r[key])
    return None if best is None else best[0]


def capacity_is_lower_bound(rows: list[dict], setup: str, key: str = "normalized_latency_s",
                            limit: float = 1.0) -> bool:
    """Whether :func:`capacity_at` of ``setup`` is only a lower bound: ``key`` stayed under ``limit`` at every swept
    rate, so the sweep stopped before the bound was crossed."""
    points = [r[key] for r in rows if r["setup"] == setup]
    return bool(points) and all(y is not None and y <= limit for y in points)


def roofline_profile(name: str, num_params: float, num_layers: int, hidden_size: int, kv_bytes_per_token: float,
                     bytes_per_param: float = 2.0, hbm_bytes_s: float = H100_SXM.bytes_per_s,
                     peak_flops: float = H100_SXM.peak_flop_per_s,
                     overhead_s: float = 1e-3, efficiency: float = 0.5) -> Profile:
    """An analytical Profile (NOT measured): a step costs ``overhead_s`` plus the larger of
    reading the weights at ``hbm_bytes_s`` and 2 * num_params FLOPs per token at ``peak_flops``,
    both derated by ``efficiency``; attention adds the KV bytes read (decode) and 4 * layers *
    hidden FLOPs per query-key pair (prefill). Defaults: an H100 SXM's bf16 peak and HBM3.
    For what-if experiments on the shape of a GPU's cost; it says so in its meta."""
    knots = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    curve = (overhead_s + roofline_step_s(num_params, knots, peak_flops * efficiency, hbm_bytes_s * efficiency,
                                          bytes_per_param)).tolist()
    coef = dict.fromkeys(FEATURES, 0.0)
    coef["decode_attention"] = kv_bytes_per_token / (hbm_bytes_s * efficiency)
    coef["prefill_attention"] = 4 * num_layers * hidden_size / (peak_flops * efficiency)
    model = LayoutModel(knots=knots, curve_s=curve, coef_s=coef)
    return Profile(model=name, layouts={"packed": model, "padded": model},
                   meta={"command": None, "analytical": "roofline, not measured",
                         "assumptions": dict(num_params=num_params, bytes_per_param=bytes_per_param,
                                             hbm_bytes_s=hbm_bytes_s, peak_flops=peak_flops,
                                             overhead_s=overhead_s, efficiency=efficiency)})
