"""Do our outputs equal HF ``generate``'s? Token equality in float32, logprob-closeness in bf16/fp16.

In float32 every greedy output must equal its reference (HF ``generate`` on the request alone,
``minibatch.reference``) token for token: the ``exact`` rule.

In reduced precision that is too strict for a correct engine: a packed batch and a lone request add
in different orders, the logits differ in their last bits, and where two tokens are nearly tied the
argmax can flip; after a flip the two continuations are different texts. vLLM's tests compare such
outputs with a logprob-closeness rule (each position: the tokens are equal, or each side's token is
among the other side's top-k logprobs, and the comparison stops at that first divergence). Our
``logprob-close`` rule is that rule with two floors a broken engine cannot pass:

* a divergence is close only where the reference itself nearly tied: its logprob of its own token
  exceeds its logprob of our token by at most ``MAX_LOGPROB_GAP`` nats (so its top-2 gap is at most
  that too), our token is in its top ``TOP_K``, and its token is in our top ``TOP_K`` (where our run
  recorded logprobs: ``SamplingParams.logprobs``; the HF peers do not, and get the reference side only);
* across the trace at least ``MIN_MATCHED_FRACTION`` of the reference tokens come before the first
  divergence of their request, counting each request's first ``MATCH_WINDOW`` tokens, so a trace
  cannot pass on near-ties alone. (The window keeps the floor independent of output length: in bf16
  SmolLM2's logits are rounded to steps of 1/32 to 1/4, exact ties are common, and a correct engine
  flips about one token in 40; over whole 256-token outputs most tokens would follow a flip.)

At an **exact tie** the reference had no preference: its logprobs of its own token and of ours are
equal (``reference_gap`` 0.0), and ``generate``'s argmax took the lower token id. Our token is as
likely as its, so the two continuations are equally the model's, and nothing after the tie can be
compared. Such a divergence is close (our-side top-k still applies) and its request counts as matched
through its window. Tiny random models in bf16 tie often. Without this, a correct engine failed the
floor on them (``python -m minibatch compare --model tiny-random-llama --clock sim --num-requests 6
--policies static,orca,paged --dtype bfloat16``: 3 of 5 divergences at gap 0.0, matched fraction 0.40;
``tests/test_precision.py`` runs it). A near-tie that is not exact (a gap of one bf16 step, 0.03125 at
logits of magnitude 4-8) still counts against the floor.

A wrong position or a lost KV block changes the logits by far more than rounding: the first
divergence comes early, where the reference is confident, and the check fails (an exact tie exactly
there is no cover: the other requests' confident divergences fail the floor).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minibatch.precision import is_reduced
from minibatch.request import Request

TOP_K = 5  # logprobs kept per position on both sides (vLLM's tests use 5)
MAX_LOGPROB_GAP = 0.5  # nats: the reference prefers its token by at most exp(0.5) = 1.65x in probability
MIN_MATCHED_FRACTION = 0.5  # of the reference tokens in each request's window, matched before its first divergence
MATCH_WINDOW = 32  # reference tokens per request that the matched fraction counts
RULES = ("exact", "logprob-close")


@dataclass(frozen=True)
class ReferenceOutput:
    """A reference output with logprobs: ``token_ids`` and, per position, {token id: logprob} of the
    ``TOP_K`` most likely tokens and the chosen one (``reference.reference_outputs(..., logprobs=k)``)."""

    token_ids: list[int]
    logprobs: list[dict[int, float]]


def with_logprobs(r: Request, num_logprobs: int) -> Request:
    """``r`` asking for ``num_logprobs`` top logprobs per output token (greedy requests; others as they are): what
    the logprob-close rule reads where a greedy output diverges."""
    if not r.sampling.is_greedy:
        return r
    return replace(r.copy(), sampling=replace(r.sampling, logprobs=num_logprobs))


def rule_for(dtype) -> str:
    """"exact" in float32, "logprob-close" in bfloat16 and float16."""
    return "logprob-close" if is_reduced(dtype) else "exact"


def first_divergence(output: list[int], reference: list[int]) -> int | None:
    """The first position where the two token lists differ (a longer list differs where the shorter
    ends); None if they are equal."""
    for i, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return i
    return None if len(output) == len(reference) else min(len(output), len(reference))


def _divergence(r: Request, ref: ReferenceOutput | list[int], i: int, rule: str) -> dict:
    """What the two sides said at position ``i`` and, for "logprob-close", whether it counts as a near-tie flip."""
    ref_ids = ref.token_ids if isinstance(ref, ReferenceOutput) else ref
    ours = r.output_token_ids[i] if i < len(r.output_token_ids) else None
    theirs = ref_ids[i] if i < len(ref_ids) else None
    d = {"position": i, "token": ours, "reference_token": theirs}
    if rule == "exact":
        return d
    if not isinstance(ref, ReferenceOutput) or ours is None or theirs is None:
        return d | {"close": False}
    top = ref.logprobs[i]
    gap = top[theirs] - top[ours] if ours in top else None
    ours_ok = gap is not None and gap <= MAX_LOGPROB_GAP
    theirs_ok = theirs in r.logprobs[i] if i < len(r.logprobs) else None  # None: our run kept no logprobs
    close = bool(ours_ok and theirs_ok is not False)
    return d | {"reference_gap": gap, "close": close, "exact_tie": close and gap == 0.0,
                "reference_token_in_our_top_k": theirs_ok}


def check_outputs(requests: list[Request], refs: dict, rule: str = "exact") -> dict:
    """Compare every request whose id is in ``refs`` with its reference, by ``rule`` ("exact" or "logprob-close"); the
    callers put only greedy requests in ``refs``.

    Args:
        requests: finished requests (their ``output_token_ids``, and ``logprobs`` if recorded).
        refs: request_id -> reference token ids, or :class:`ReferenceOutput` (needed by "logprob-close").

    Returns a JSON-ready report: ``rule``, its thresholds, ``passed`` (None when no request has a
    reference), ``matched_fraction`` (of the first ``MATCH_WINDOW`` reference tokens of each request, the
    share before its first divergence; all of them after an exact tie) and ``divergences``: request_id ->
    its first divergence (position, both tokens and, for "logprob-close", the reference's logprob gap,
    whether it counts as close and whether it was an exact tie).

    Raises:
        ValueError: an unknown rule.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    checked = [r for r in requests if r.request_id in refs]
    report = {"rule": rule}
    if rule == "logprob-close":
        report |= {"top_k": TOP_K, "max_logprob_gap": MAX_LOGPROB_GAP, "min_matched_fraction": MIN_MATCHED_FRACTION,
                   "match_window": MATCH_WINDOW}
    matched = total = 0
    divergences = {}
    for r in checked:
        ref = refs[r.request_id]
        ref_ids = ref.token_ids if isinstance(ref, ReferenceOutput) else ref
        i = first_divergence(r.output_token_ids, ref_ids)
        window = min(len(ref_ids), MATCH_WINDOW)
        total += window
        if i is None:
            matched += window
            continue
        divergences[r.request_id] = d = _divergence(r, ref, i, rule)
        matched += window if d.get("exact_tie") else min(i, window)  # after an exact tie nothing is comparable
    fraction = matched / total if total else 1.0
    if rule == "exact":
        passed = not divergences
    else:
        passed = all(d["close"] for d in divergences.values()) and fraction >= MIN_MATCHED_FRACTION
    return report | {"passed": passed if checked else None, "num_requests": len(checked),
                     "matched_fraction": round(fraction, 4), "divergences": divergences}


def matches_reference(requests: list[Request], refs: dict, rule: str = "exact") -> bool | None:
    """True if every greedy request with a reference passes ``rule`` (see :func:`check_outputs`); None if
    none has one."""
    return check_outputs(requests, refs, rule)["passed"]
