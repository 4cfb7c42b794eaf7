"""What a step costs (notebook 00, section 7): the wall time of one forward against the tokens it computes,
measured on this CPU for prefill tokens and decode rows at equal counts, the model's bare matrix products, and
the roofline bound (``minibatch.roofline``) of this CPU and of a GPU.

A step reads every weight once and computes 2 FLOPs per parameter per token. While the weight read dominates,
the step is memory-bound and its time stays flat as tokens are added; past the ridge point the arithmetic
dominates, the step is compute-bound and its time grows in proportion to the tokens.
"""

import statistics
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import MaxNLocator

from minibatch.roofline import Roofline, median_time_s, ridge_tokens, roofline_step_s, torch_threads
from minibatch.runner.batch import PackedSequence
from minibatch.viz.plots import PALETTE

BLOCK_SIZE = 16
# prefill and decode as in every Gantt chart; the two models of the roofline in blue and vermillion
COLORS = {"prefill": PALETTE["prefill"], "decode": PALETTE["decode"], "fit": "#000000", "small": "#0072B2",
          "large": "#D55E00"}


def _sequences(num_seqs: int, num_new_tokens: int, context: int) -> list[PackedSequence]:
    """``num_seqs`` sequences of ``num_new_tokens`` tokens after ``context`` cached ones, each sampling one token;
    sequence i owns its own blocks of the KV cache."""
    blocks = -(-(context + num_new_tokens) // BLOCK_SIZE)
    return [PackedSequence(f"s{i}", [100 + (i + t) % 1000 for t in range(num_new_tokens)], context,
                           list(range(i * blocks, (i + 1) * blocks)), 1) for i in range(num_seqs)]


def _timed(runner, seqs: list[PackedSequence]) -> float:
    t0 = time.perf_counter()
    runner.forward_sequences(seqs)
    return time.perf_counter() - t0


def measure_step_cost(runner, token_counts=(1, 2, 3, 4, 8, 16, 32, 64, 128), context: int = 32, repeats: int = 5,
                      num_threads: int | None = 1) -> dict[str, list]:
    """Step times (s) on the wall clock at equal token counts: for each N in ``token_counts``, one prefill of N
    tokens (one sequence, no context) and one decode step of N rows (one new token each, ``context`` cached).

    The sizes are timed interleaved (round r times every prefill and decode once, then round r + 1), so a slow
    spell of a shared machine touches every size alike, and each size reports the median of ``repeats`` rounds.
    num_threads: torch CPU threads while timing (restored afterwards; None leaves them).
    Returns {"prefill": [(N, median_s), ...], "decode": [(N, median_s), ...],
    "spread": {"prefill": [(N, (max - min) / median), ...], "decode": [...]}}."""
    plans = {"prefill": {n: _sequences(1, n, 0) for n in token_counts},
             "decode": {n: _sequences(n, 1, context) for n in token_counts}}
    num_blocks = 1 + max(b for kind in plans.values() for seqs in kind.values() for s in seqs for b in s.block_table)
    runner.allocate_kv_cache(max(64, num_blocks), BLOCK_SIZE)
    with torch_threads(num_threads):
        _timed(runner, plans["prefill"][token_counts[-1]])  # warm-up: first calls allocate and pick kernels
        times = {kind: {n: [] for n in token_counts} for kind in plans}
        for _ in range(repeats):
            for n in token_counts:
                for kind in plans:
                    times[kind][n].append(_timed(runner, plans[kind][n]))
    out = {kind: [(n, statistics.median(ts)) for n, ts in t.items()] for kind, t in times.items()}
    out["spread"] = {kind: [(n, (max(ts) - min(ts)) / statistics.median(ts)) for n, ts in t.items()]
                     for kind, t in times.items()}
    return out


def time_linear_layers(model, rows=(1, 2, 3, 4, 8, 16), repeats: int = 5, num_threads: int | None = 1):
    """Wall time (s) of the model's bare matrix products for each number of input rows: every ``nn.Linear`` of the
    model once (the decoder layers' projections and the LM head, fp32, inputs of ``rows`` x in_features), no
    attention, no Python scheduling. Median of ``repeats``. Returns [(rows, s), ...]: whether a step's jump from
    one row to two is the model's arithmetic or the matrix library's choice of kernel."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    out = []
    with torch_threads(num_threads), torch.inference_mode():
        for n in rows:
            inputs = [torch.randn(n, m.in_features, dtype=m.weight.dtype) for m in linears]
            out.append((n, median_time_s(lambda: [m(x) for m, x in zip(linears, inputs)], repeats)))
    return out


def knee_tokens(points: list[tuple[int, float]], tail: int = 3) -> tuple[float, float]:
    """The measured knee of a step-cost curve: (knee tokens, per-token s). per-token s is the slope of a line
    fitted to the ``tail`` largest token counts (the compute-bound end); the knee is where that per-token cost
    adds up to the time of the smallest step (the weight read): smallest_s / per_token_s, the measured twin of
    the roofline's ridge point."""
    tokens, seconds = np.array(sorted(points)[-tail:], dtype=float).T
    per_token_s = float(np.polyfit(tokens, seconds, 1)[0])
    return min(points)[1] / per_token_s, per_token_s


def plot_step_cost(measured: dict[str, list], linears: list[tuple[int, float]], cpu: Roofline, num_params: float,
                   bytes_per_param: int, title: str):
    """Left: measured step time (ms) vs tokens in the step (log scale), prefill and decode, with this CPU's
    roofline bound for the model's weights, the measured knee and the ridge point of ``cpu``. Right: the bare
    matrix products of the model (``linears``: [(rows, s)]) vs rows."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10.5, 3.8), layout="constrained", width_ratios=(1.5, 1))
    for kind, marker in (("prefill", "o"), ("decode", "s")):
        x, y = np.array(measured[kind], dtype=float).T
        label = "prefill: 1 sequence of N tokens" if kind == "prefill" else "decode: N rows of 1 token"
        ax.plot(x, y * 1e3, marker=marker, color=COLORS[kind], linewidth=1, markersize=6, label=label)
    tokens = np.geomspace(1, max(n for n, _ in measured["prefill"]), 100)
    ax.plot(tokens, cpu.step_s(num_params, tokens, bytes_per_param) * 1e3, color=COLORS["fit"], linestyle="--",
            linewidth=1, label="roofline bound from this CPU's peak and bandwidth")
    knee, _ = knee_tokens(measured["prefill"])
    ridge = cpu.ridge_tokens(bytes_per_param)
    for at, style, text in ((knee, "-", f"measured knee ≈ {knee:.0f}"), (ridge, ":", f"ridge ≈ {ridge:.0f}")):
        ax.axvline(at, color=COLORS["fit"], linestyle=style, linewidth=0.8)
        ax.text(at * 1.08, 0.97, text, transform=ax.get_xaxis_transform(), fontsize=8.5, va="top")
    ax.set(xscale="log", xlabel="tokens computed in the step (N)", ylabel="step time (ms)", ylim=(0, None))
    ax.set_xticks([n for n, _ in measured["prefill"]], [str(n) for n, _ in measured["prefill"]])
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="center left")
    x, y = np.array(linears, dtype=float).T
    bx.plot(x, y * 1e3, marker="D", color=COLORS["small"], linewidth=1)
    bx.set(xlabel="rows in the input", ylabel="time (ms)", ylim=(0, None))
    bx.xaxis.set_major_locator(MaxNLocator(integer=True))
    bx.set_title("the model's matrix products alone (no attention)", fontsize=10)
    for a in (ax, bx):
        a.tick_params(labelsize=9)
        a.grid(alpha=0.3)
    return fig


def plot_roofline(models: dict[str, float], gpu: Roofline, max_tokens: int = 8192):
    """Two panels on a log scale: the roofline step time (ms) and the time per token (µs) vs tokens per step,
    one line per model ({name: parameters}, bf16 weights), the ridge point marked."""
    peak, bandwidth = gpu.peak_flop_per_s, gpu.bytes_per_s
    tokens = np.unique(np.geomspace(1, max_tokens, 200).round())
    ridge = ridge_tokens(peak, bandwidth)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    for (name, params), color, style in zip(models.items(), (COLORS["small"], COLORS["large"]), ("-", "--")):
        step = roofline_step_s(params, tokens, peak, bandwidth)
        ax.plot(tokens, step * 1e3, color=color, linestyle=style, linewidth=2, label=name)
        bx.plot(tokens, step / tokens * 1e6, color=color, linestyle=style, linewidth=2, label=name)
    for a in (ax, bx):
        a.axvline(ridge, color="black", linestyle=":", linewidth=1)
        a.set(xscale="log", yscale="log", xlabel="tokens per step")
        a.tick_params(labelsize=9)
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=9, loc="upper left" if a is ax else "lower left")
    ax.text(ridge * 1.15, np.sqrt(np.prod(ax.get_ylim())) * 0.7, f"ridge ≈\n{ridge:.0f} tokens", fontsize=9, va="top")
    ax.text(1.3, ax.get_ylim()[1] / 4, "memory-bound:\nflat", fontsize=9, va="top")
    ax.text(ridge * 2, ax.get_ylim()[1] / 4, "compute-bound:\n∝ tokens", fontsize=9, va="top")
    ax.set(ylabel="step time, lower bound (ms)", title=f"{gpu.name}, bf16: one step")
    bx.set(ylabel="time per token (µs)", title="the same step, per token computed")
    return fig
