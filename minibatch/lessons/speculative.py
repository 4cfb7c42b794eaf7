"""Notebook 06 (speculative decoding) and ``benchmarks/spec_decode.py``: tables, glue, the exercise check.

Leviathan et al. 2023 / Chen et al. 2023: a cheap draft proposes k tokens, the target checks all
of them in ONE forward (k+1 positions), and the rejection sampler keeps a prefix so the output
follows the target's distribution exactly. It pays when a target forward over k+1 tokens costs
little more than over one (decode is memory-bound) and the draft is cheap and often right. The
machinery is ``minibatch/spec``; the experiments are in ``minibatch.experiments``
(``spec_exactness``: the distribution test; ``speculative``: k sweeps on real models;
``spec_speedup``: the speedup model and the batch sweep), the figures in ``minibatch.viz.speculative``.
Here: :func:`print_rows`, :func:`plot_speedup_vs_alpha`, :func:`check_rejection_sampler` and the exercise
check :func:`check_my_rejection_sample`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from minibatch.experiments.spec_exactness import chi_square_pvalue, first_token_histograms, spec_sequences  # noqa: F401
from minibatch.experiments.spec_speedup import (alpha_from_acceptance_length, batch_sweep_sim,  # noqa: F401
                                                break_even_alpha, predicted_speedup, sim_verify_cost_ratio)
from minibatch.experiments.speculative import GROUNDED_PROMPTS, k_sweep  # noqa: F401
from minibatch.lessons import exercise
from minibatch.viz.speculative import plot_distribution, plot_spec_timeline, plot_speedup_vs_batch  # noqa: F401
from minibatch.viz.speculative import plot_speedup_curves

# Speedups the papers report, at their scale, both at batch size 1 on accelerators: Leviathan et al.,
# "Fast Inference from Transformers via Speculative Decoding" (ICML 2023): 2-3x on T5-XXL (11B) with a
# T5-small draft; Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling"
# (2023): 2-2.5x on Chinchilla 70B with a 4B draft.
PAPER_CLAIMS = {"leviathan_t5xxl_speedup": (2.0, 3.0), "chen_chinchilla_speedup": (2.0, 2.5)}


def check_rejection_sampler(fn: Callable, n: int = 20_000, seed: int = 3) -> float:
    """``fn(target_probs, draft_tokens, draft_probs, generator)`` must emit tokens distributed
    exactly as the target (chi-square p > 1e-3 over n sequences). Returns p.

    Raises:
        AssertionError: the distribution is off, or fn returns something other than 1..k+1 ints.
        exercise.NotYet: fn returns None (a body still ``...``).
    """
    counts, expected = spec_sequences(_checked(fn), n, seed=seed)
    p = chi_square_pvalue(counts, expected)
    assert p > 1e-3, f"the emitted tokens do not follow the target (chi-square p = {p:.2g})"
    return p


@exercise.check(hint="section 2: accept a draft with probability min(1, p/q); at the first rejection, "
                     "sample from normalize(max(p - q, 0)); all accepted: a bonus token from the last row of p")
def check_my_rejection_sample(fn: Callable, n: int = 20_000, seed: int = 3) -> str:
    """The exercise check: :func:`check_rejection_sampler` on the student's ``fn``, as one printed line
    (``exercise.check``); returns whether the emitted tokens follow the target."""
    p = check_rejection_sampler(fn, n, seed)
    return f"the emitted tokens follow the target (chi-square p = {p:.3f} over {n:,} sequences)"


def _checked(fn: Callable) -> Callable:
    def wrapped(p, drafts, q, g):
        out = exercise.require(fn(p, drafts, q, g), "my_rejection_sample")
        assert isinstance(out, list) and 1 <= len(out) <= len(drafts) + 1, f"must return 1..k+1 tokens, got {out!r}"
        return [int(t) for t in out]

    return wrapped


def print_rows(rows: list[dict]) -> None:
    """The k-sweep table: throughput, decode speedup, acceptance rate, mean acceptance length."""
    print(f"{'run':<24}{'out tok/s':>10}{'TPOT p50 ms':>12}{'decode x':>9}{'accept':>8}{'mean len':>9}")
    for r in rows:
        sp = r.get("spec", {})
        print(f"{r['run']:<24}{r['output_throughput_tok_s']:>10.1f}{r['tpot_p50_s'] * 1e3:>12.1f}"
              f"{r.get('decode_speedup', 1.0):>9.2f}{sp.get('acceptance_rate', float('nan')):>8.1%}"
              f"{sp.get('mean_acceptance_length', float('nan')):>9.2f}")


def plot_speedup_vs_alpha(verify_cost_ratio: float, draft_cost_ratio: float, ks=(1, 2, 4, 6), ax=None,
                          measured: list[tuple[float, float, str]] = (), title: str | None = None):
    """Predicted batch-1 speedup against Leviathan's per-token alpha (not vLLM's acceptance rate)
    for each k, for this machine's v and c; ``measured`` (alpha, speedup, label) points on top, their
    alpha e.g. from :func:`alpha_from_acceptance_length`. Returns the Axes."""
    alphas = np.linspace(0, 0.98, 50)
    curves = {f"k={k}": (alphas, [predicted_speedup(a, k, verify_cost_ratio, draft_cost_ratio) for a in alphas])
              for k in ks}
    return plot_speedup_curves(curves, ax, measured, xlabel="per-token acceptance probability (alpha)", title=title)
