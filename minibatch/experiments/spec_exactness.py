"""Speculative decoding is exact: a rejection sampler's tokens follow the target's distribution.

A random bigram "model" stands in for the target (P) and one for the draft (Q), over V tokens:
speculative decoding with any sampler function samples sequences, and Pearson's chi-square test
compares their counts with the target's own probabilities (the proof: Leviathan et al. 2023).
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

import numpy as np
import torch


def bigram_models(V: int = 6, seed: int = 0, concentration: float = 0.7) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, Q): a random bigram target and draft over V tokens; row P[prev] is the next-token distribution."""
    with torch.random.fork_rng(devices=[]):  # seeded locally: the caller's RNG stream is untouched
        torch.manual_seed(seed)
        dirichlet = torch.distributions.Dirichlet(torch.full((V,), concentration))
        return dirichlet.sample((V,)), dirichlet.sample((V,))


def spec_sequences(sampler: Callable, n: int = 20_000, V: int = 6, length: int = 3, k: int = 3,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sample n sequences of ``length`` tokens after token 0 from the bigram target P by speculative
    decoding with the bigram draft Q (k drafts per round, ``sampler`` accepts them). Returns
    (observed counts, expected counts under P) over the V**length sequences, in
    ``itertools.product`` order."""
    P, Q = bigram_models(V, seed)
    g = torch.Generator().manual_seed(seed + 1)
    counts = np.zeros(V ** length)
    for _ in range(n):
        seq = [0]
        while len(seq) < length + 1:
            drafts, prev = [], seq[-1]
            for _ in range(k):
                prev = int(torch.multinomial(Q[prev], 1, generator=g))
                drafts.append(prev)
            rows = [seq[-1]] + drafts
            seq += sampler(P[rows], drafts, Q[rows[:-1]], g)
        counts[np.ravel_multi_index(seq[1:length + 1], (V,) * length)] += 1
    sequences = itertools.product(range(V), repeat=length)
    expected = [math.prod(float(P[a, b]) for a, b in zip((0,) + s, s)) for s in sequences]
    return counts, np.array(expected) * n


def chi_square_pvalue(counts: np.ndarray, expected: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson's chi-square goodness of fit, pooling cells with expected count < min_expected."""
    from scipy.stats import chi2

    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    return float(chi2.sf(((obs - exp) ** 2 / exp).sum(), len(obs) - 1))


def first_token_histograms(samplers: dict[str, Callable], n: int = 20_000, V: int = 6, seed: int = 0) -> dict:
    """For each sampler: the first token's empirical distribution and the 3-token chi-square
    p-value; plus the target's P[0] and the draft's Q[0]."""
    P, Q = bigram_models(V, seed)
    out = {"target": P[0].tolist(), "draft": Q[0].tolist(), "samplers": {}}
    for name, fn in samplers.items():
        counts, expected = spec_sequences(fn, n, V, seed=seed)
        first = counts.reshape(V, -1).sum(1) / n
        out["samplers"][name] = {"first_token": first.tolist(), "p_value": chi_square_pvalue(counts, expected)}
    return out
