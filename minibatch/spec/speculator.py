"""How many draft tokens each request gets (k), and what speculation achieved (stats).

* :class:`FixedK`: every decoding request drafts k tokens.
* :class:`AdaptiveK`: per request, from its own acceptance history. With Leviathan's per-token
  acceptance rate alpha (each draft token accepted independently with probability alpha), a
  verification of k drafts emits on average

      E[tokens](k) = sum_{i=0..k} alpha^i = (1 - alpha^(k+1)) / (1 - alpha)

  tokens (Leviathan et al. 2023, Eq. 1) and costs v + c k decode-step units: v is a verify
  forward's cost relative to a plain decode (about 1 where decode is memory-bound, as on a GPU;
  ~1.5 measured on a 2-core CPU, see ``measure_verify_cost``) and c one draft step's, learned from
  the engine's step records.
  AdaptiveK picks the k in 0..max_k with the most tokens per unit cost (k = 0: a plain decode,
  1 token for 1 unit), so with a poor draft it stops speculating.

Two acceptance quantities, kept apart: Leviathan's alpha is the probability that *one* draft
token is accepted given the ones before it were; vLLM's acceptance rate
(``SpecDecodingStats.acceptance_rate``) is accepted / drafted over all verifications, which for
k drafts is (alpha + ... + alpha^k) / k, below alpha. AdaptiveK estimates alpha.

The executor asks ``num_spec_tokens(request)`` when it proposes a request's next drafts, right
after verifying this step's; the request's own ``spec_history`` (stored by the scheduler's
update: (drafted, accepted) per verification) is the one feedback path, in real and simulated
runs alike. Step costs come from the engine's records (``observe_step``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minibatch.checks import MAX_SPEC_TOKENS, check_int, check_real
from minibatch.config import option
from minibatch.request import Request


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens emitted by one verification of k drafts] = sum_{i=0..k} alpha^i (alpha in [0, 1], k in [0, 64];
    Leviathan et al., ICML'23 §3.1, Eq. 1). Raises ValueError (FieldTypeError: not a number) outside them."""
    check_real(alpha, "alpha (the acceptance rate)", 0.0, 1.0)
    return sum(alpha ** i for i in range(check_int(k, "k", 0, MAX_SPEC_TOKENS) + 1))


def predicted_speedup(alpha: float, k: int, verify_cost_ratio: float, draft_cost_ratio: float) -> float:
    """Batch-1 speedup over plain decoding: expected_tokens(alpha, k) / (v + c k), in decode-step units
    (alpha: Leviathan's per-token acceptance probability; k = 0 is a plain decode, speedup 1). Leviathan et al.,
    ICML'23 §3's walltime improvement, with a verify forward costing v decode steps instead of 1. Raises ValueError
    (FieldTypeError: not a number): alpha or k as :func:`expected_tokens`, v outside (0, 1e6], c outside [0, 1e6]."""
    check_real(verify_cost_ratio, "verify_cost_ratio", 0.0, 1e6, low_open=True)
    check_real(draft_cost_ratio, "draft_cost_ratio", 0.0, 1e6)
    return expected_tokens(alpha, k) / (verify_cost_ratio + draft_cost_ratio * k) if k else 1.0


def best_k(alpha: float, draft_cost_ratio: float, max_k: int, verify_cost_ratio: float = 1.0) -> int:
    """argmax over k in 0..max_k of :func:`predicted_speedup` (k = 0: a plain decode, 1 token for 1 unit)."""
    return max(range(max_k + 1), key=lambda k: sum(alpha ** i for i in range(k + 1)) / (  # unchecked: every step
        verify_cost_ratio + draft_cost_ratio * k) if k else 1.0)


def num_next_drafts(request: Request, emitted, speculator, pending: tuple[int, int] | None = None) -> int:
    """k for a request's next step, after it got ``emitted`` tokens this step: 0 if they finish it
    (EOS unless ignore_eos, a stop token id, or max_new_tokens); else the request's own ``num_speculative_tokens``
    or ``speculator.num_spec_tokens`` (``pending``: this step's (drafted, accepted)), capped so the
    next step (1 + k tokens) emits at most the tokens the request may still produce."""
    if any(request.stops_at(t, request.num_output_tokens + i) for i, t in enumerate(emitted)):
        return 0
    left = request.max_new_tokens - request.num_output_tokens - len(emitted)
    k = request.num_speculative_tokens
    if k is None:
        k = speculator.num_spec_tokens(request, pending)
    return max(0, min(k, left - 1))


def rows_to_draft(plan, sampled: dict, accepted: dict, speculator) -> list[tuple]:
    """(scheduled row, k) for each row of ``plan`` that sampled this step and drafts next (k >= 1,
    from :func:`num_next_drafts`, with this step's (drafted, accepted) as the pending observation).
    ``sampled``/``accepted``: the step's StepResult fields, before the scheduler's update."""
    rows = []
    for s in plan.scheduled:
        if s.request_id in sampled:
            pending = (s.num_spec_tokens, accepted[s.request_id]) if s.spec_token_ids else None
            k = num_next_drafts(s.request, sampled[s.request_id], speculator, pending)
            if k > 0:
                rows.append((s, k))
    return rows


class FixedK:
    """k draft tokens for every decoding request (k >= 0; 0 turns speculation off).

    Raises:
        ValueError: k outside [0, 64].
    """

    def __init__(self, k: int = 4):
        self.k = self.max_k = check_int(k, "num_speculative_tokens (k)", 0, MAX_SPEC_TOKENS)

    def num_spec_tokens(self, request: Request, pending: tuple[int, int] | None = None) -> int:
        return self.k

    def observe_step(self, record) -> None:
        pass

    def __repr__(self) -> str:
        return f"FixedK(k={self.k})"


class AdaptiveK:
    """Choose k per request from its acceptance history and the measured draft cost.

    Two estimates of Leviathan's alpha (see ``alpha``): the workload's, pooled over every
    verification in the engine's step records (the last ``pooled_window`` trials), and each
    request's, over its own last ``window`` trials shrunk toward the pooled one (toward
    ``prior_alpha`` before any step was seen). k = ``best_k`` of the request's estimate.

    Args:
        max_k: the largest k tried (>= 1).
        prior_alpha: alpha assumed before any verification was seen, in (0, 1).
        prior_weight: how many trials the pooled estimate counts as in a request's (>= 0).
        window: trials of history used per request (>= 1; a verification of d drafts accepting
            a is a + 1 trials, or d if all were accepted).
        pooled_window: trials of history in the pooled estimate (>= 1).
        draft_cost_ratio: c, a draft step's time over a target step's; None: measured from the
            engine's step records (``observe_step``), starting from ``initial_cost_ratio``.
        verify_cost_ratio: v, a verify forward's time over a plain decode's (>= 1 in practice;
            default 1, the memory-bound ideal; ``measure_verify_cost`` gives this machine's).

    Raises:
        ValueError: an argument out of range (the message names it).
    """

    def __init__(self, max_k: int = 8, prior_alpha: float = 0.6, prior_weight: float = 8.0, window: int = 64,
                 draft_cost_ratio: float | None = None, initial_cost_ratio: float = 0.1,
                 verify_cost_ratio: float = 1.0, pooled_window: int = 2048):
        check_int(max_k, "max_k", 1, MAX_SPEC_TOKENS)
        check_real(prior_alpha, "prior_alpha", 0.0, 1.0, low_open=True, high_open=True)
        for value, name in ((verify_cost_ratio, "verify_cost_ratio"), (initial_cost_ratio, "initial_cost_ratio"),
                            (draft_cost_ratio, "draft_cost_ratio")):  # (best_k then runs unchecked, every step)
            if value is not None:
                check_real(value, name, 0.0, 1e6, low_open=name == "verify_cost_ratio")
        if prior_weight < 0 or window < 1 or pooled_window < 1:
            raise ValueError(f"need prior_weight >= 0, window >= 1 and pooled_window >= 1, "
                             f"got {prior_weight}, {window}, {pooled_window}")
        self.max_k = max_k
        self.prior_alpha, self.prior_weight, self.window = prior_alpha, prior_weight, window
        self.pooled_window = pooled_window
        self.pooled: list[tuple[int, int]] = []  # (drafted, accepted) of recent verifications, all requests
        self.fixed_cost_ratio = draft_cost_ratio
        self.verify_cost_ratio = verify_cost_ratio
        self.cost_ratio = draft_cost_ratio if draft_cost_ratio is not None else initial_cost_ratio

    def alpha(self, request: Request | None = None, pending: tuple[int, int] | None = None) -> float:
        """Leviathan's per-token alpha: the chance that a draft token is accepted given the one
        before it was. A verification of d drafts that accepts a < d is a + 1 such trials with a
        successes; accepting all d is d trials, d successes (the maximum-likelihood estimate is
        successes / trials; accepted / drafted, vLLM's acceptance rate, is lower: it counts the
        positions after a rejection as failures).

        request None: the pooled estimate (``prior_alpha`` until a verification is seen).
        Otherwise the request's: its ``spec_history`` plus ``pending`` (this step's (drafted,
        accepted), not stored yet), shrunk toward the pooled estimate by ``prior_weight`` trials.
        """
        if request is None:
            trials, successes = _trials(self.pooled, self.pooled_window)
            return self.prior_alpha if trials == 0 else min(max(successes / trials, 1e-6), 1 - 1e-6)
        trials, successes = _trials(request.spec_history + ([pending] if pending else []), self.window)
        est = (successes + self.alpha() * self.prior_weight) / (trials + self.prior_weight)
        return min(max(est, 1e-6), 1 - 1e-6)

    def num_spec_tokens(self, request: Request, pending: tuple[int, int] | None = None) -> int:
        """k for the request's next step (``pending``: this step's (drafted, accepted), see ``alpha``)."""
        return best_k(self.alpha(request, pending), self.cost_ratio, self.max_k, self.verify_cost_ratio)

    def observe_step(self, record) -> None:
        """One engine step's record (its clock's times, so a simulated run stays deterministic):
        draft_time_s over its draft forwards (the largest k in the step) against the rest of the
        step. Updates c, in decode-step units (a verify step is v of them), by an exponential
        average, unless it was fixed. Adds the record's verifications to the pooled alpha."""
        self.pooled += [(e.num_spec_tokens, e.num_accepted_tokens) for e in record.entries if e.num_spec_tokens]
        if len(self.pooled) > 2 * self.pooled_window:  # keep the list short (each verification is >= 1 trial)
            self.pooled = self.pooled[-self.pooled_window:]
        rounds = len(record.draft_forwards)
        verify_s = record.duration_s - record.draft_time_s
        if self.fixed_cost_ratio is None and rounds and record.draft_time_s > 0 and verify_s > 0:
            c = record.draft_time_s / rounds / verify_s * self.verify_cost_ratio
            self.cost_ratio = 0.8 * self.cost_ratio + 0.2 * c

    def __repr__(self) -> str:
        return f"AdaptiveK(max_k={self.max_k}, c={self.cost_ratio:.3f}, v={self.verify_cost_ratio:.2f})"


def _trials(history: list[tuple[int, int]], window: int) -> tuple[int, int]:
    """(trials, successes) of alpha over the latest verifications of ``history`` ((drafted,
    accepted) each) holding at most ``window`` trials (the latest always counts)."""
    trials = successes = 0
    for d, a in reversed(history):
        n = a + (a < d)
        if trials and trials + n > window:
            break
        trials += n
        successes += a
    return trials, successes


@dataclass
class SpecDecodingStats:
    """Counters with vLLM's SpecDecodingStats meanings.

    num_drafts: verifications (one request, one step) with >= 1 draft token.
    num_draft_tokens / num_accepted_tokens: draft tokens proposed / accepted.
    num_accepted_tokens_per_pos[i]: verifications whose draft token at position i was accepted.
    num_draft_tokens_per_pos[i]: verifications that had a draft token at position i.
    draft_time_s / verify_time_s: seconds in the proposer / in target forwards of steps with drafts.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for counts, n in ((self.num_draft_tokens_per_pos, num_draft), (self.num_accepted_tokens_per_pos, num_accepted)):
            counts += [0] * max(0, n - len(counts))
            for i in range(n):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """num_accepted_tokens / num_draft_tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + num_accepted_tokens / num_drafts: tokens emitted per verification, bonus included."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """num_accepted_tokens_per_pos[i] / num_drafts (vLLM's per-position acceptance rate)."""
        return [a / self.num_drafts for a in self.num_accepted_tokens_per_pos] if self.num_drafts else []

    @property
    def conditional_acceptance_per_pos(self) -> list[float]:
        """P(position i accepted | a draft token existed there): accepted_i / drafted_i."""
        return [a / d if d else 0.0 for a, d in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    def make_stats(self) -> dict:
        """A run row's share: {"spec_decoding": as_dict()} once any draft token was proposed, else {}."""
        return {"spec_decoding": self.as_dict()} if self.num_draft_tokens else {}

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "acceptance_rate_per_pos": [round(x, 4) for x in self.acceptance_rate_per_pos],
                "draft_time_s": round(self.draft_time_s, 4), "verify_time_s": round(self.verify_time_s, 4)}


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding's settings, added to a speculative policy's scheduler config (policies.py)."""

    num_speculative_tokens: int = option(4, "draft tokens per step, k (with adaptive k: the largest)", "int",
                                         low=1, high=MAX_SPEC_TOKENS)
    adaptive_k: bool = option(False, "choose k per request from its acceptance history", "bool")

    def speculator(self) -> "FixedK | AdaptiveK":
        k = self.num_speculative_tokens
        return AdaptiveK(max_k=k) if self.adaptive_k else FixedK(k)
