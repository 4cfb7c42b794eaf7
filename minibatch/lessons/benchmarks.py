"""Scale experiments in simulation, for notebook 07 and ``benchmarks/sim_scale.py``.

The simulator (``minibatch.sim``) runs our real schedulers on a calibrated clock, so thousands
of requests take seconds. Here:

* :func:`rate_sweep` / :func:`plot_rate_sweep`: request rate against throughput and tail latency
  for static batching at several batch sizes and the continuous policies (the throughput-latency
  curves of Orca §6 and vLLM §6);
* :func:`offline_table`: every request at t = 0, the most requests per second each setup serves
  (the shape of the often-quoted table: static bs=64 44.2 req/s vs continuous 482 req/s);
* :func:`capacity_at`: the highest rate whose latency stays under a bound (how Orca and vLLM
  state their "x times the throughput at the same latency");
* :func:`roofline_profile`: an *analytical* profile of a GPU (step time = max(bytes moved /
  bandwidth, FLOPs / peak) + overhead): a what-if, never a measurement, labelled so wherever used.

The papers' headline claims and their conditions are in CLAIMS. Rows are plain JSON-ready dicts.
"""

from __future__ import annotations

import numpy as np

from minibatch.metrics import summarize
from minibatch.policies import make_engine
from minibatch.request import Request
from minibatch.sim.executor import SimExecutor
from minibatch.clock import SimClock
from minibatch.sim.cost_model import FEATURES, LayoutModel, Profile

CLAIMS = {
    "seed_table": "static batching bs=64: 44.2 req/s vs continuous batching: 482 req/s (10.9x), "
                  "the often-quoted table; its model, hardware and trace are not stated there",
    "orca": "Orca (OSDI'22 §6.2): 36.9x the throughput of NVIDIA FasterTransformer (request-level "
            "batching) at the same latency, GPT-3 175B on 16 A100s, synthetic trace",
    "vllm": "vLLM (SOSP'23 §6.2): 2-4x the throughput of Orca and FasterTransformer at the same "
            "normalized latency, OPT-13B..175B on A100s, ShareGPT and Alpaca traces",
}

# Setups: name -> (make_engine policy, its options). Static batching is request-level batching
# (FasterTransformer's); orca reserves prompt + max_new_tokens per request ("Orca (Max)" when the
# reservation is the server's length limit); paged and chunked allocate blocks on demand.
DEFAULT_SETUPS = {
    "static bs=8": ("static", dict(max_num_seqs=8)),
    "static bs=32": ("static", dict(max_num_seqs=32)),
    "static bs=64": ("static", dict(max_num_seqs=64)),
    "orca": ("orca", {}),
    "paged": ("paged", {}),
    "chunked": ("chunked", dict(max_num_batched_tokens=512)),
}


def run_sim(profile: Profile, policy: str, requests: list[Request], *, max_num_seqs: int = 256, n_slots: int = 65536,
            max_wait_s: float = 0.5, **kwargs):
    """Fresh copies of ``requests`` under ``policy`` on ``profile``'s clock; returns (requests, engine)."""
    reqs = [r.copy() for r in requests]
    engine = make_engine(policy, SimExecutor(), SimClock(profile, profile), max_num_seqs=max_num_seqs, n_slots=n_slots,
                         max_wait_s=max_wait_s, **kwargs)
    engine.generate(reqs)
    return reqs, engine


def summary_row(name: str, rate: float | None, reqs: list[Request], engine) -> dict:
    """One row of a sweep or table: the setup, the rate (requests/s) and the run's metrics."""
    s = summarize(reqs, engine.trace)
    e2e_per_token = [(r.finish_time_s - r.arrival_time_s) / r.num_output_tokens for r in reqs]
    return {"setup": name, "rate": rate, "num_requests": s.num_requests,
            "request_throughput_req_s": s.request_throughput_req_s, "output_throughput_tok_s": s.output_throughput_tok_s,
            "ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s, "e2e_p50_s": s.e2e_p50_s, "e2e_p99_s": s.e2e_p99_s,
            "tpot_p50_s": s.tpot_p50_s,
            # vLLM's normalized latency: mean over requests of end-to-end latency / output length
            "normalized_latency_s": float(np.mean(e2e_per_token)),
            "mean_batch_size": s.mean_batch_size, "num_preemptions": s.num_preemptions, "num_steps": s.num_steps}


def rate_sweep(profile: Profile, trace_fn, rates, setups: dict | None = None, **engine_kwargs) -> list[dict]:
    """For each rate (requests/s) and setup: ``trace_fn(rate)`` (a list of requests) through the
    setup on the simulated clock. Rows: setup, rate, throughputs, TTFT / E2E p50 and p99,
    normalized latency (s per output token), mean batch size, preemptions."""
    rows = []
    for rate in rates:
        requests = trace_fn(rate)
        for name, (policy, kwargs) in (setups or DEFAULT_SETUPS).items():
            reqs, engine = run_sim(profile, policy, requests, **{**engine_kwargs, **kwargs})
            rows.append(summary_row(name, rate, reqs, engine))
    return rows


def offline_table(profile: Profile, requests: list[Request], setups: dict | None = None, **engine_kwargs) -> list[dict]:
    """Every request at t = 0 (arrivals ignored): each setup's request and output throughput."""
    at_zero = [Request(r.request_id, r.prompt_token_ids, r.max_new_tokens, r.sampling) for r in requests]
    rows = []
    for name, (policy, kwargs) in (setups or DEFAULT_SETUPS).items():
        reqs, engine = run_sim(profile, policy, at_zero, **{**engine_kwargs, **kwargs})
        rows.append(summary_row(name, None, reqs, engine))
    return rows


def capacity_at(rows: list[dict], setup: str, key: str = "normalized_latency_s", limit: float = 1.0) -> float | None:
    """The highest swept rate at which ``setup``'s ``key`` stays <= ``limit`` and every lower
    rate does too (None: not even the lowest rate)."""
    best = None
    for r in sorted((r for r in rows if r["setup"] == setup), key=lambda r: r["rate"]):
        if r[key] is None or r[key] > limit:
            break
        best = r["rate"]
    return best


def plot_rate_sweep(rows: list[dict], y: str = "e2e_p99_s", ax=None, title: str | None = None):
    """Output throughput (x) against ``y`` (a latency), one line per setup, a point per rate."""
    import matplotlib.pyplot as plt

    from minibatch.viz.results import POLICY_COLORS

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    styles = {"static bs=8": ":", "static bs=32": "--", "static bs=64": "-.", "orca (max)": "--"}
    for name in dict.fromkeys(r["setup"] for r in rows):
        pts = sorted((r for r in rows if r["setup"] == name), key=lambda r: r["rate"])
        color = POLICY_COLORS.get(name.split()[0], None)
        ax.plot([p["output_throughput_tok_s"] for p in pts], [p[y] for p in pts], marker="o", ms=3,
                ls=styles.get(name, "-"), color=color, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel(y.replace("_s", " (s)").replace("_", " "))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def roofline_profile(name: str, num_params: float, num_layers: int, hidden_size: int, kv_bytes_per_token: float,
                     bytes_per_param: float = 2.0, hbm_bytes_s: float = 3.35e12, peak_flops: float = 989e12,
                     overhead_s: float = 1e-3, efficiency: float = 0.5) -> Profile:
    """An analytical Profile (NOT measured): a step costs ``overhead_s`` plus the larger of
    reading the weights at ``hbm_bytes_s`` and 2 * num_params FLOPs per token at ``peak_flops``,
    both derated by ``efficiency``; attention adds the KV bytes read (decode) and 4 * layers *
    hidden FLOPs per query-key pair (prefill). Defaults: an H100 SXM's bf16 peak and HBM3.
    For what-if experiments on the shape of a GPU's cost; it says so in its meta."""
    knots = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    weights_s = num_params * bytes_per_param / (hbm_bytes_s * efficiency)
    curve = [overhead_s + max(weights_s, 2 * num_params * n / (peak_flops * efficiency)) for n in knots]
    coef = dict.fromkeys(FEATURES, 0.0)
    coef["decode_attention"] = kv_bytes_per_token / (hbm_bytes_s * efficiency)
    coef["prefill_attention"] = 4 * num_layers * hidden_size / (peak_flops * efficiency)
    model = LayoutModel(knots=knots, curve_s=curve, coef_s=coef)
    return Profile(model=name, layouts={"packed": model, "padded": model},
                   meta={"command": None, "analytical": "roofline, not measured",
                         "assumptions": dict(num_params=num_params, bytes_per_param=bytes_per_param,
                                             hbm_bytes_s=hbm_bytes_s, peak_flops=peak_flops,
                                             overhead_s=overhead_s, efficiency=efficiency)})


# ---------------------------------------------------------------------- the calibrated clock, checked
def profile_samples(profile: Profile, layout: str = "packed") -> tuple[list[dict], np.ndarray]:
    """The calibration samples of one layout and the profile's predicted times for them (s)."""
    from minibatch.sim.cost_model import StepShape

    rows = [s for s in profile.meta.get("samples", []) if s["layout"] == layout]
    shapes = [StepShape.from_sample(s) for s in rows]
    return rows, profile.predict(shapes) if rows else np.zeros(0)


def plot_cost_model(profile: Profile, axes=None):
    """Left: measured vs predicted step time of every calibration step (both layouts; the band
    is +-15%). Right: packed steps' time against num_tokens, with the fitted curve(N)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    ax, ax2 = axes
    for layout, marker in (("packed", "o"), ("padded", "s")):
        rows, pred = profile_samples(profile, layout)
        if rows:
            ax.scatter([r["time_s"] * 1e3 for r in rows], pred * 1e3, s=8, marker=marker, alpha=0.5, label=layout)
    lim = np.array(ax.get_xlim())
    ax.plot(lim, lim, color="black", lw=0.8)
    ax.fill_between(lim, lim * 0.85, lim * 1.15, color="grey", alpha=0.15, label="+-15%")
    ax.set(xscale="log", yscale="log", xlabel="measured step time (ms)", ylabel="predicted (ms)",
           title="every calibration step, measured vs the fit")
    ax.legend(fontsize=8)
    rows, _ = profile_samples(profile, "packed")
    kinds = {"decode": "decode batches", "long": "long context", "prefill": "one prefill", "chunked": "chunked trace"}
    for kind, label in kinds.items():
        pts = [r for r in rows if r["scenario"].startswith(kind)]
        ax2.scatter([r["num_tokens"] for r in pts], [r["time_s"] * 1e3 for r in pts], s=8, alpha=0.5, label=label)
    m = profile.layouts["packed"]
    ax2.plot(m.knots, np.array(m.curve_s) * 1e3, color="black", lw=1, marker="|", label="fitted curve(N)")
    ax2.set(xscale="log", yscale="log", xlabel="tokens in the step (N)", ylabel="step time (ms)",
            title="packed steps: cost against tokens")
    ax2.legend(fontsize=8)
    return axes


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


def plot_validation(report: dict, ax=None):
    """Simulation error of output throughput and TTFT p50, per trace and policy (bars); the
    dashed lines are the acceptance bound (15%), the dotted ones the goal (10%)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 3.5), layout="constrained")
    labels, thr, ttft = [], [], []
    for name, t in report["traces"].items():
        for r in t["policies"]:
            labels.append(f"{r['policy']}\n{name.split('-seed')[0]}")
            thr.append(r["error"]["output_throughput_tok_s"] * 100)
            ttft.append(r["error"]["ttft_p50_s"] * 100)
    x = np.arange(len(labels))
    ax.bar(x - 0.2, thr, 0.4, label="output throughput", color="#0072B2")
    ax.bar(x + 0.2, ttft, 0.4, label="TTFT p50", color="#E69F00")
    for y, ls in ((15, "--"), (10, ":")):
        ax.axhline(y, color="grey", ls=ls, lw=0.8)
        ax.axhline(-y, color="grey", ls=ls, lw=0.8)
    ax.set_xticks(x, labels, fontsize=6, rotation=90)
    ax.set_ylabel("simulated vs measured (%)")
    ax.legend(fontsize=8)
    return ax


def best_decode_batch(profile: Profile, context: int = 200, max_batch: int = 64) -> int:
    """The exercise's answer: the decode batch size in 1..max_batch with the most predicted
    tokens per second at ``context`` tokens of context per request."""
    from minibatch.sim.cost_model import StepShape

    sizes = np.arange(1, max_batch + 1)
    times = profile.predict([StepShape(num_tokens=int(b), logits=int(b), decode_attention=int(b) * context) for b in sizes])
    return int(sizes[np.argmax(sizes / times)])
