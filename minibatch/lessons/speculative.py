"""Notebook 06 (speculative decoding) and ``benchmarks/spec_decode.py``: tables, glue, the exercise check.

Leviathan et al. 2023 / Chen et al. 2023: a cheap draft proposes k tokens, the target checks all
of them in ONE forward (k+1 positions), and the rejection sampler keeps a prefix so the output
follows the target's distribution exactly. It pays when a target forward over k+1 tokens costs
little more than over one (decode is memory-bound) and the draft is cheap and often right. The
machinery is ``minibatch/spec``; the experiments are in ``minibatch.experiments``
(``spec_exactness``: the distribution test; ``speculative``: k sweeps on real models;
``spec_speedup``: the speedup model and the batch sweep), the figures in ``minibatch.viz.speculative``.
Here: :func:`print_rows`, the speedup model against measured runs (:func:`speedup_model`,
:func:`print_speedup_model`, :func:`plot_speedup_vs_alpha`), :func:`print_against_papers`, :func:`sim_clock_costs`,
:func:`sampler_histograms` (section 2's demo),
:func:`check_rejection_sampler` (output length, bonus token, distribution) and the exercise check
:func:`check_my_rejection_sample`.

The speedup model is one function, :func:`predicted_speedup`: k drafts cost k forwards of the draft (c target
decodes each) and one verify forward (v decodes), and emit E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) tokens
on average, so the expected speedup over plain decoding is E(alpha, k) / (k c + v) (Leviathan et al. 2023, who
take v = 1). The break-even alpha, the curves and ``AdaptiveK``'s choice of k all use it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from minibatch.experiments.spec_exactness import chi_square_pvalue, first_token_histograms, spec_sequences
from minibatch.experiments.spec_speedup import (alpha_from_acceptance_length, break_even_alpha, predicted_speedup)
from minibatch.claims import claim
from minibatch.lessons import exercise
from minibatch.viz.speculative import plot_speedup_curves

# The papers' speedups and alphas, at their scale, come from minibatch.claims ("leviathan-speedup",
# "leviathan-alpha", "chen-speedup"): batch size 1 on accelerators.
CLAIM_IDS = ("leviathan-speedup", "leviathan-alpha", "chen-speedup")


def sampler_histograms(n: int = 20_000) -> dict:
    """Section 2's demo: :func:`first_token_histograms` of the library's rejection sampler and of the wrong one that
    resamples from p (``naive_sample``), keyed "rejection sampler" and "wrong: resample from p"."""
    from minibatch.spec.rejection_sampler import naive_sample, rejection_sample

    return first_token_histograms({"rejection sampler": rejection_sample, "wrong: resample from p": naive_sample}, n=n)


def _bonus_case(k: int = 3, V: int = 6):
    """(p, drafts, q): the draft's q equals the target's p at every drafted position, so every draft is accepted
    (u * q(x) < p(x) for any u < 1); p's last row, where the bonus token is sampled, differs from the others."""
    import torch

    rows = torch.full((k, V), 1.0 / V)
    last = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.05, 0.05])[:V]
    return torch.cat([rows, (last / last.sum())[None]]), [2] * k, rows.clone()


def check_bonus_token(fn: Callable, n: int = 3000, seed: int = 5) -> None:
    """When every one of k drafts is accepted, ``fn`` must return k + 1 tokens: the k drafts, then a bonus token
    sampled from the target's last row (chi-square p > 1e-3 over n draws).

    Raises:
        AssertionError: naming the property that failed ("output length" or "bonus token").
    """
    import torch

    p, drafts, q = _bonus_case()
    k, g, counts = len(drafts), torch.Generator().manual_seed(seed), np.zeros(p.shape[1])
    for _ in range(n):
        out = _checked(fn)(p, drafts, q, g)
        assert len(out) == k + 1, (f"{'bonus token' if len(out) == k else 'output length'}: all {k} drafts were "
                                   f"accepted (q = p), so {k + 1} tokens must come out (the drafts, then one from "
                                   f"target_probs[{k}]); got {len(out)}")
        assert out[:k] == drafts, f"accepted drafts: the first {k} tokens must be the drafts {drafts}, got {out}"
        counts[out[k]] += 1
    from scipy.stats import chi2

    expected = p[k].numpy() * n  # every cell over 5 draws: no pooling needed
    pv = float(chi2.sf(((counts - expected) ** 2 / expected).sum(), len(expected) - 1))
    assert pv > 1e-3, (f"bonus token: after {k} accepted drafts it must be sampled from target_probs[{k}] "
                       f"(chi-square p = {pv:.2g} over {n:,} draws)")


def check_rejection_sampler(fn: Callable, n: int = 20_000, seed: int = 3) -> float:
    """``fn(target_probs, draft_tokens, draft_probs, generator)`` must return 1..k+1 ints (output length), k + 1 of
    them when all k drafts are accepted, the last a bonus token from the target's row k (:func:`check_bonus_token`),
    and emit tokens distributed exactly as the target (distribution: chi-square p > 1e-3 over n sequences).
    Returns p.

    Raises:
        AssertionError: its message starts with the property that failed: "output length", "bonus token" or
            "distribution".
        exercise.NotYet: fn returns None (a body still ``...``).
    """
    check_bonus_token(fn)
    counts, expected = spec_sequences(_checked(fn), n, seed=seed)
    p = chi_square_pvalue(counts, expected)
    assert p > 1e-3, f"distribution: the emitted tokens do not follow the target (chi-square p = {p:.2g})"
    return p


@exercise.check(hint="section 2: accept a draft with probability min(1, p/q); at the first rejection, "
                     "sample from normalize(max(p - q, 0)); all accepted: a bonus token from the last row of p")
def check_my_rejection_sample(fn: Callable, n: int = 20_000, seed: int = 3) -> str:
    """The exercise check: :func:`check_rejection_sampler` on the student's ``fn``, as one printed line
    (``exercise.check``); returns whether every property held."""
    p = check_rejection_sampler(fn, n, seed)
    return (f"k + 1 tokens with a bonus from the target when all k drafts pass, and the emitted tokens follow the "
            f"target (chi-square p = {p:.3f} over {n:,} sequences)")


def _checked(fn: Callable) -> Callable:
    def wrapped(p, drafts, q, g):
        out = exercise.require(fn(p, drafts, q, g), "my_rejection_sample")
        assert isinstance(out, list) and 1 <= len(out) <= len(drafts) + 1, \
            f"output length: must return a list of 1..k+1 tokens, got {out!r}"
        return [int(t) for t in out]

    return wrapped


def print_rows(rows: list[dict]) -> None:
    """The k-sweep table: throughput, decode speedup, acceptance rate, mean acceptance length ("-" for a run
    without drafts)."""
    print(f"{'run':<24}{'out tok/s':>10}{'TPOT p50 ms':>12}{'decode x':>9}{'accept':>8}{'mean len':>9}")
    for r in rows:
        sp = r.get("spec", {})
        accept = f"{sp['acceptance_rate']:.1%}" if "acceptance_rate" in sp else "-"
        length = f"{sp['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in sp else "-"
        print(f"{r['run']:<24}{r['output_throughput_tok_s']:>10.1f}{r['tpot_p50_s'] * 1e3:>12.1f}"
              f"{r.get('decode_speedup', 1.0):>9.2f}{accept:>8}{length:>9}")


def plot_speedup_vs_alpha(verify_cost_ratio: float, draft_cost_ratio: float, ks=(1, 2, 4, 6), ax=None,
                          measured: list[tuple[float, float, str]] = (), title: str | None = None):
    """Predicted batch-1 speedup against Leviathan's per-token alpha (not vLLM's acceptance rate)
    for each k, for this machine's v and c; ``measured`` (alpha, speedup, label) points on top, their
    alpha e.g. from :func:`alpha_from_acceptance_length`. Returns the Axes."""
    alphas = np.linspace(0, 0.98, 50)
    curves = {f"k={k}": (alphas, [predicted_speedup(a, k, verify_cost_ratio, draft_cost_ratio) for a in alphas])
              for k in ks}
    return plot_speedup_curves(curves, ax, measured, xlabel="per-token acceptance probability (alpha)", title=title)


def speedup_model(rows: list[dict], verify_cost_ratio: float, draft_cost_ratio: float) -> list[dict]:
    """The speedup model beside measured runs: for each fixed-k draft run of a k sweep (:func:`k_sweep` rows named
    "draft k=K"), vLLM's acceptance rate (accepted / drafted), the per-token alpha its mean acceptance length
    implies (:func:`alpha_from_acceptance_length`), the break-even alpha (:func:`break_even_alpha`), and the
    speedup :func:`predicted_speedup` gives at that alpha next to the measured decode speedup.

    Returns rows {k, acceptance_rate, alpha, break_even_alpha, predicted, measured} (speedups over plain decoding).
    """
    out = []
    for r in rows:
        if not r["run"].startswith("draft k="):
            continue
        k, spec = int(r["run"].split("=")[1]), r["spec"]
        alpha = alpha_from_acceptance_length(spec["mean_acceptance_length"], k)
        out.append({"k": k, "acceptance_rate": spec["acceptance_rate"], "alpha": alpha,
                    "break_even_alpha": break_even_alpha(k, verify_cost_ratio, draft_cost_ratio),
                    "predicted": predicted_speedup(alpha, k, verify_cost_ratio, draft_cost_ratio),
                    "measured": r["decode_speedup"]})
    return out


def print_speedup_model(model_rows: list[dict]) -> None:
    """The table of :func:`speedup_model`: one line per k."""
    print(f"{'k':>3}{'acceptance rate':>17}{'alpha':>7}{'break-even alpha':>18}{'predicted':>11}{'measured':>10}")
    for r in model_rows:
        print(f"{r['k']:>3}{r['acceptance_rate']:>17.1%}{r['alpha']:>7.2f}{r['break_even_alpha']:>18.2f}"
              f"{r['predicted']:>10.2f}x{r['measured']:>9.2f}x")


def print_against_papers(measured: dict) -> None:
    """Batch-1 decode speedups of a ``benchmarks/spec_decode.py`` result beside the papers' (:data:`CLAIM_IDS`),
    with this machine's v and c and the per-token alpha of the draft."""
    b1, v, c = measured["batch1"], measured["verify_cost_ratio"], measured["draft_cost_ratio"]
    print("decode speedup over no speculation at batch 1, measured here (wall clock):")
    print(f"  {b1['best_fixed_k'] + ' (the best fixed k)':<36}{b1['best_decode_speedup']:.2f}x "
          f"(end-to-end {b1['best_speedup']:.2f}x)")
    rows = [r for r in b1["rows"] if r["run"].startswith(("draft adaptive", "n-gram"))]
    rows += [dict(r, run=r["run"] + ", input-grounded prompts") for r in measured.get("grounded", {}).get("rows", [])
             if r["run"].startswith("n-gram")]
    for r in rows:
        print(f"  {r['run']:<36}{r['decode_speedup']:.2f}x")
    alphas = [r["alpha"] for r in speedup_model(b1["rows"], v, c)]
    print(f"  per-token alpha of the draft: {min(alphas):.2f}-{max(alphas):.2f}; a verify forward costs v = {v:.2f}"
          f" decodes, a draft forward c = {c:.3f}")
    (lo, hi), (a_lo, a_hi) = claim("leviathan-speedup").values["speedup"], claim("leviathan-alpha").values["alpha"]
    c_lo, c_hi = claim("chen-speedup").values["speedup"]
    print("reported by the papers, batch 1 on accelerators (a verify forward costs about one decode there):")
    print(f"  Leviathan et al., T5-XXL (11B): {lo}-{hi}x over standard T5X (up to "
          f"{max(claim('leviathan-speedup').numbers)}x with a T5-small draft); alpha {a_lo}-{a_hi} with T5 drafts")
    print(f"  Chen et al., Chinchilla 70B, 4B draft: {c_lo}-{c_hi}x")


def sim_clock_costs(clock) -> str:
    """What a ``SimClock`` charges (its target and draft ``CostModel``), as one line in milliseconds."""
    t, d = clock.cost_model, clock.draft_cost_model
    return (f"simulated clock (not measured): a target forward {t.fixed_s * 1e3:g} ms + {t.per_seq_s * 1e3:g} ms per "
            f"sequence + {t.per_token_s * 1e3:g} ms per token computed + {t.per_context_token_s * 1e3:g} ms per "
            f"context token; a draft forward {d.fixed_s * 1e3:g} ms + {d.per_seq_s * 1e3:g} ms per sequence + "
            f"{d.per_token_s * 1e3:g} ms per token")
