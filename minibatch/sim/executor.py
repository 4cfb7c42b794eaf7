"""SimExecutor: an executor with no model, for the simulator and scheduler tests.

Every scheduled request that reaches its last token gets a made-up token; speculative decoding
is simulated by accepting made-up drafts with a given probability (Leviathan et al.'s i.i.d.
per-token acceptance alpha) and recording the draft forwards a draft model would have run, so a
simulated clock can price them. The schedulers, the block manager and the engine are the real ones.
"""

from __future__ import annotations

import copy
import random
from numbers import Real

from minibatch.checks import FieldTypeError, check_int, check_real, short_repr
from minibatch.runner.kv_owner import KVOwnership
from minibatch.scheduler.output import SchedulerOutput, StepResult
from minibatch.spec.speculator import SpecDecodingStats, rows_to_draft


class SimExecutor(KVOwnership):
    """No model: made-up tokens (use ignore_eos requests: there is no EOS).

    acceptance_rate: speculative decoding without models: each stored draft token is accepted
        with this probability (independently: Leviathan's per-token alpha; seeded by ``seed``)
        until the first rejection; ``stats`` counts. A list gives vLLM's per-position acceptance
        rates instead (the fraction of drafts at position i accepted, as ``SpecDecodingStats``
        measures them; non-increasing): position i is accepted with probability rate[i] /
        rate[i-1] once i-1 was; past the list the last such ratio repeats (rate[-1] / rate[-2]: the rates go on
        decaying geometrically).
    speculator: FixedK or AdaptiveK: k for each request's next drafts (``make_engine`` runs a speculative policy
        on :meth:`with_speculator`'s copy); None: no drafts are proposed.
    draft_forwards: record the draft forwards (a draft model); False for n-gram lookup, whose
        drafting costs no forward.
    proposal_rate: the probability that a row gets drafts at all (n-gram lookup finds no match
        for some; such a row decodes 1 token next step, as with SpeculativeRunner).
    draft_catch_up: the first draft forward carries every token the draft has not seen yet (a
        request's whole prompt the first time, then the accepted drafts and the bonus token), as
        DraftModelProposer does; False: one token per row (the older, simpler model).
    vocab_size: None (default): prompts may hold any id and made-up tokens are < 32000; an int:
        the simulated model's vocabulary (``Engine.add_request`` refuses ids >= it).
    max_model_len: the simulated model's context in tokens (``Engine.add_request`` refuses a request longer).

    Raises:
        ValueError: acceptance_rate or proposal_rate outside [0, 1], per-position rates that increase, an empty
            list, max_model_len or vocab_size below 1, a speculator without acceptance_rate.
        FieldTypeError: a value of the wrong type (a bool, a str).
    """

    eos_token_ids: tuple[int, ...] = ()
    simulates_drafts = True  # make_engine runs a speculative policy on with_speculator's copy (no SpeculativeRunner)

    def __init__(self, max_model_len: int = 1 << 20, vocab_size: int | None = None,
                 acceptance_rate: float | list[float] | None = None, seed: int = 0, draft_forwards: bool = True,
                 proposal_rate: float = 1.0, draft_catch_up: bool = False, speculator=None):
        check_int(max_model_len, "max_model_len", 1)
        if vocab_size is not None:
            check_int(vocab_size, "vocab_size", 1)
        rates = [acceptance_rate] if isinstance(acceptance_rate, (Real, str)) else acceptance_rate
        if rates is not None and not isinstance(rates, (list, tuple)):
            raise FieldTypeError(f"acceptance_rate must be in [0, 1] (or a list of such), got {short_repr(rates)}")
        if rates is not None and not rates:
            raise ValueError("acceptance_rate must be in [0, 1] (or a non-empty list of such), got []")
        for a in rates or ():
            check_real(a, "acceptance_rate (each rate)", 0.0, 1.0)
        if rates is not None and any(b > a for a, b in zip(rates, rates[1:])):
            raise ValueError(f"acceptance_rate per-position rates must be non-increasing, got {short_repr(rates)}")
        check_real(proposal_rate, "proposal_rate", 0.0, 1.0)
        if speculator is not None:
            _check_can_draft(acceptance_rate)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.acceptance_rate = acceptance_rate
        self.speculator = speculator
        self.draft_forwards = draft_forwards
        self.proposal_rate = proposal_rate
        self.draft_catch_up = draft_catch_up
        self._draft_seen: dict[str, int] = {}  # request_id -> leading tokens valid in the draft's KV
        # conditional probability of accepting position i given position i-1 was accepted
        self._accept_p = None if rates is None else [
            a / prev if prev > 0 else 0.0 for a, prev in zip(rates, [1.0] + list(rates[:-1]))]
        self.rng = random.Random(seed)
        self.stats = SpecDecodingStats()

    def _token(self, num_tokens: int, request_id: str, banned: tuple[int, ...] = ()) -> int:
        """A made-up token, not one of ``banned`` (min_tokens' EOS and stop ids) where the vocabulary has another."""
        vocab = self.vocab_size or 32000
        token = (7919 * num_tokens + len(request_id)) % vocab
        for _ in range(min(len(banned), vocab - 1)):
            if token not in banned:
                break
            token = (token + 1) % vocab
        return token

    def execute(self, out: SchedulerOutput) -> StepResult:
        sampled: dict[str, tuple[int, ...]] = {}
        accepted: dict[str, int] = {}
        for s in out.scheduled:
            r = s.request
            if s.spec_token_ids:
                a = 0
                while a < s.num_spec_tokens and self.rng.random() < self._accept_p[min(a, len(self._accept_p) - 1)]:
                    a += 1
                sampled[r.request_id] = s.spec_token_ids[:a] + (self._token(r.num_tokens + a + 1, r.request_id),)
                accepted[r.request_id] = a
                self.stats.observe(s.num_spec_tokens, a)
            elif s.samples:
                sampled[r.request_id] = (self._token(r.num_tokens, r.request_id, r.banned_token_ids()),)
        drafts, forwards = self._propose(out, sampled, accepted)
        return StepResult(sampled=sampled, num_accepted=accepted, spec_token_ids=drafts, draft_forwards=forwards)

    def _propose(self, out: SchedulerOutput, sampled: dict, accepted: dict):
        """Made-up drafts for the next step of every row that sampled and goes on, and the draft
        forwards (rows, tokens, context tokens) a draft model would run for them."""
        if self.speculator is None:
            return {}, ()
        plan = [(s.request_id, s.request.num_tokens + len(sampled[s.request_id]), k)  # tokens after this step
                for s, k in rows_to_draft(out, sampled, accepted, self.speculator)
                if self.proposal_rate >= 1.0 or self.rng.random() < self.proposal_rate]
        forwards = []
        for j in range(max((k for _, _, k in plan), default=0) if self.draft_forwards else 0):
            rows = [(rid, n) for rid, n, k in plan if k > j]  # draft forward j: one token per request
            tokens = len(rows)
            if j == 0 and self.draft_catch_up:  # the tokens the draft has not seen, up to the last one
                tokens = sum(n - min(self._draft_seen.get(rid, 0), n - 1) for rid, n in rows)
            forwards.append((len(rows), tokens, sum(n + j for _, n in rows)))
        for rid, n, _ in plan:
            self._draft_seen[rid] = n - 1  # valid below the last token (lookahead slots are freed)
        drafts = {rid: tuple(self._token(n + i, rid) for i in range(k)) for rid, n, k in plan}
        return drafts, tuple(forwards)

    def with_speculator(self, speculator) -> "SimExecutor":
        """A copy of this executor that proposes drafts with ``speculator`` (its own draft bookkeeping; the random
        stream and ``stats`` are shared with this one). This executor is left as it was: ``make_engine`` gives a
        speculative policy the copy, so a later policy on the same executor proposes no drafts.

        Raises:
            ValueError: this executor has no acceptance_rate.
        """
        _check_can_draft(self.acceptance_rate)
        twin = copy.copy(self)
        twin.speculator, twin._draft_seen = speculator, {}
        return twin

    def make_stats(self) -> dict:
        """The drafts proposed and accepted ("spec_decoding", once any was proposed)."""
        return self.stats.make_stats()

    def observe_step(self, record) -> None:
        """The speculator learns from the step records, as with a real SpeculativeRunner."""
        if self.speculator is not None:
            self.speculator.observe_step(record)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        pass

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._draft_seen.pop(rid, None)

    def release_state(self) -> None:
        self._draft_seen = {}


def _check_can_draft(acceptance_rate) -> None:
    if acceptance_rate is None:
        raise ValueError("SimExecutor with a speculator needs acceptance_rate= to simulate speculative decoding")
