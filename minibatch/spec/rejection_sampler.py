"""Speculative sampling: accept or reject draft tokens so the output follows the target exactly.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding", §2.3 and
Appendix A.1) and Chen et al. 2023 (DeepMind, Algorithm 2). Given k draft tokens x_1..x_k, the
draft's distributions q_1..q_k and the target's distributions p_1..p_{k+1} (one forward over the
k+1 positions), for i = 1..k:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
    on the first rejection: sample from normalize(max(p_i - q_i, 0)) and stop
    if all k are accepted: sample a bonus token from p_{k+1}

Every emitted token is then distributed exactly as p (the proof: P(emit x) =
q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * max(p(x) - q(x), 0) / sum_y max(p(y) - q(y), 0)
= min(p(x), q(x)) + max(p(x) - q(x), 0) = p(x)). Greedy decoding is the limit where p and q are
one-hot at their argmax: accept while the draft token equals the target's argmax.

p and q must be the distributions the requests actually sample from, so temperature, top-k and
top-p are applied to both logits in the same way (``processed_probs``).

A proposer without probabilities (n-gram lookup) is deterministic: q is one-hot at its token, the
rule above accepts x with probability p(x) and on rejection samples p without x. Sampling the
target's token t ~ p and accepting x iff t == x is the same distribution (P(accept) = p(x),
P(emit y != x) = p(y)), so ``sample_verify`` does exactly that: it draws each position's token
from the request's own generator the way a plain decode does (one draw per emitted token), and a
seeded request gets the same tokens whatever k, batch or preemptions: a non-speculative run's
(up to the float rounding of the logits).

With a draft *model* (``rejection_sample``) a seeded request's tokens depend on the schedule:
verifying position j draws a uniform (and a residual sample on rejection) where a plain decode
draws from p, so they depend on which positions were verified against drafts -- k, the first
token after each prefill or re-prefill (never drafted), preemptions (the draft's own stream
restarts). A run is still reproducible, and every schedule samples exactly the target's
distribution. Not made schedule-independent on purpose: that needs a draft token to be accepted
only when it equals the target's own sample, which for a sampled draft accepts with probability
sum_x q(x) p(x) instead of sum_x min(p(x), q(x)) -- fewer accepted tokens for the same output.
"""

from __future__ import annotations

from typing import Callable

import torch

from minibatch.request import SamplingParams
from minibatch.runner.sampler import filter_logits


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., vocab_size) logits -> the probabilities a request samples from: temperature, top-k and
    top-p applied (``filter_logits``), then softmax, in float32. Greedy: one-hot at the argmax."""
    logits = logits.float()
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    flat = logits.reshape(-1, logits.shape[-1])
    return torch.stack([filter_logits(row, params).softmax(-1) for row in flat]).reshape(logits.shape)


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """Tokens to emit for one request: the accepted draft tokens, then one more (a resampled token
    at the first rejection, or the bonus token when all are accepted).

    Args:
        target_probs: (k + 1, vocab_size) float, the target's processed distributions at the k+1
            verified positions (row i follows draft token i-1).
        draft_token_ids: the k draft tokens (k >= 0).
        draft_probs: (k, vocab_size), the draft's processed distributions the tokens were sampled
            from; None for a deterministic proposer (q one-hot at each token).
        generator: the request's torch.Generator (its seeded stream).

    Returns: a list of 1 .. k+1 token ids; ``len(result) - 1`` draft tokens were accepted.

    Raises:
        ValueError: shapes that do not match k.
    """
    k = len(draft_token_ids)
    if target_probs.shape[0] != k + 1 or (draft_probs is not None and draft_probs.shape[0] != k):
        raise ValueError(f"target_probs needs k+1 = {k + 1} rows and draft_probs k = {k} rows, got "
                         f"{tuple(target_probs.shape)} and {None if draft_probs is None else tuple(draft_probs.shape)}")
    out: list[int] = []
    uniforms = torch.rand(k, generator=generator, device=target_probs.device) if k else None
    for i, x in enumerate(draft_token_ids):
        p = target_probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if float(uniforms[i]) * q_x < float(p[x]):  # u < p(x) / q(x), without dividing by q(x) = 0
            out.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any sample of p is exact
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out


def sample_verify(draft_token_ids: list[int], sample: Callable[[int], int]) -> list[int]:
    """Verification for a deterministic proposer (q one-hot at each draft token): the target's
    token at each position in turn, ``sample(i)`` (row i follows draft token i-1), kept while it
    equals the draft; the first mismatch (or the bonus token after k matches) ends it.

    Exactly the target's distribution, the same as ``rejection_sample`` with ``draft_probs=None``
    (see the module docstring), but it calls ``sample`` once per emitted token and in order, so a
    request's seeded stream is consumed as by plain decodes: its tokens do not depend on k or on
    the schedule. With ``sample(i)`` = the argmax of row i this is ``greedy_verify``.

    Returns: 1 .. k+1 token ids; ``len(result) - 1`` draft tokens were accepted.
    """
    out: list[int] = []
    for i, x in enumerate(draft_token_ids):
        out.append(sample(i))
        if out[-1] != x:
            return out
    out.append(sample(len(draft_token_ids)))
    return out


def greedy_verify(target_argmax: list[int], draft_token_ids: list[int]) -> list[int]:
    """Greedy verification: accept draft tokens while they equal the target's argmax, then emit
    the target's argmax at the first mismatch (or the bonus argmax after k matches).
    target_argmax: the k+1 argmax ids. Returns 1 .. k+1 tokens."""
    out: list[int] = []
    for x, t in zip(draft_token_ids, target_argmax):
        if x != t:
            break
        out.append(x)
    out.append(target_argmax[len(out)])
    return out


def naive_sample(target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
                 generator: torch.Generator | None = None) -> list[int]:
    """A WRONG sampler, kept to show what the statistical test catches: it accepts like
    ``rejection_sample`` but on rejection samples from p itself instead of the residual
    max(p - q, 0), so tokens the draft likes are over-represented."""
    out: list[int] = []
    k = len(draft_token_ids)
    uniforms = torch.rand(k, generator=generator) if k else None
    for i, x in enumerate(draft_token_ids):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if float(uniforms[i]) * q_x < float(target_probs[i, x]):
            out.append(x)
            continue
        out.append(int(torch.multinomial(target_probs[i], 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out
