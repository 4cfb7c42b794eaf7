"""What a step costs: the wall time of one forward against the tokens it computes, measured on this CPU, and the
roofline lower bound of the same step on a GPU from its public peak numbers.

A step is one forward of the model over every token scheduled in it (notebook 00). Its time has a part that does
not depend on the tokens (reading every weight once, launching the layers) and a part that grows with them (2
FLOPs per parameter per token). Which part dominates decides whether batching more tokens into a step is nearly
free (a GPU below its ridge point) or costs almost in proportion (a CPU).
"""

import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import MaxNLocator

from minibatch.experiments.rate_sweep import roofline_step_s  # noqa: F401 (notebook 00 uses it from here)
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


def time_step(runner, num_seqs: int, num_new_tokens: int, context: int = 0, repeats: int = 3) -> float:
    """Best-of-``repeats`` wall time (s) of one packed forward of ``runner`` (a ModelRunner): ``num_seqs``
    sequences of ``num_new_tokens`` new tokens after ``context`` cached tokens each (the cached K/V are whatever
    the cache holds: attention costs the same for any values). Allocates the runner's KV cache to fit."""
    seqs = _sequences(num_seqs, num_new_tokens, context)
    runner.allocate_kv_cache(max(64, sum(len(s.block_table) for s in seqs)), BLOCK_SIZE)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward_sequences(seqs)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_step_cost(runner, prefill_tokens=(1, 16, 64, 128, 256), decode_batches=(1, 2, 4, 8, 16),
                      context: int = 32, repeats: int = 3, num_threads: int | None = 1) -> dict[str, list]:
    """Step times (s) on the wall clock: one prefill of each size in ``prefill_tokens`` (one sequence, no context),
    and one decode step of each batch size in ``decode_batches`` (one new token per sequence, ``context`` cached).

    num_threads: torch CPU threads while timing (restored afterwards; None leaves them): one thread keeps the
    times steady on a shared CPU. Returns {"prefill": [(tokens, s), ...], "decode": [(batch, s), ...]}."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or old_threads)
    try:
        time_step(runner, 1, 16)  # warm-up: first calls allocate and pick kernels
        return {"prefill": [(n, time_step(runner, 1, n, 0, repeats)) for n in prefill_tokens],
                "decode": [(b, time_step(runner, b, 1, context, repeats)) for b in decode_batches]}
    finally:
        torch.set_num_threads(old_threads)


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed_s, per_token_s) of time = fixed_s + per_token_s * tokens over (tokens, s) points, by least squares
    on relative errors (times spanning 30x weigh alike)."""
    tokens, seconds = np.array(points, dtype=float).T
    per_token_s, fixed_s = np.polyfit(tokens, seconds, 1, w=1 / seconds)
    return float(fixed_s), float(per_token_s)


def ridge_tokens(peak_flop_per_s: float, bytes_per_s: float, bytes_per_param: int = 2) -> float:
    """Tokens per step at which computing them takes as long as reading the weights: below it a step is
    memory-bound (its time barely grows with tokens), above it compute-bound. Independent of model size."""
    return peak_flop_per_s * bytes_per_param / (2 * bytes_per_s)


def plot_step_cost(measured: dict[str, list], fit: tuple[float, float], title: str, zoom_tokens: int = 20):
    """Measured step time (ms) vs tokens in the step: prefill and decode points and the line fitted to the
    prefills, over every size (left) and up to ``zoom_tokens`` tokens (right)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    for ax, x_max in zip(axes, (max(n for n, _ in measured["prefill"]), zoom_tokens)):
        for kind, marker in (("prefill", "o"), ("decode", "s")):
            x, y = np.array([p for p in measured[kind] if p[0] <= x_max], dtype=float).T
            label = "prefill: 1 sequence, no context" if kind == "prefill" else "decode: a batch of 1-token rows"
            ax.plot(x, y * 1e3, marker=marker, color=COLORS[kind], linestyle="none", markersize=7, label=label)
        x = np.linspace(0, x_max, 50)
        ax.plot(x, (fit[0] + fit[1] * x) * 1e3, color=COLORS["fit"], linestyle="--", linewidth=1,
                label=f"fit to prefill: {fit[0] * 1e3:.0f} ms + {fit[1] * 1e3:.2f} ms per token")
        ax.set(xlabel="tokens computed in the step", ylabel="step time (ms)", xlim=(-0.02 * x_max, 1.04 * x_max),
               ylim=(0, None))
        ax.tick_params(labelsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_title(title, fontsize=10)
    axes[1].set_title(f"the same, up to {zoom_tokens} tokens", fontsize=10)
    axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=8.5, loc="upper left")
    return fig


def plot_roofline(models: dict[str, float], gpu: dict[str, float], gpu_name: str, max_tokens: int = 8192):
    """Two panels on a log scale: the roofline step time (ms) and the time per token (µs) vs tokens per step,
    one line per model ({name: parameters}, bf16 weights), the ridge point marked."""
    peak, bandwidth = gpu["peak_bf16_flop_per_s"], gpu["hbm_bytes_per_s"]
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
    ax.set(ylabel="step time, lower bound (ms)", title=f"{gpu_name}, bf16: one step")
    bx.set(ylabel="time per token (µs)", title="the same step, per token computed")
    return fig
