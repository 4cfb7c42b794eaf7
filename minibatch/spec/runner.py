"""SpeculativeRunner: speculative decoding inside continuous batching.

One engine step, for the scheduler's plan (Leviathan et al. 2023, Algorithm 1, batched; the
order of vLLM v1, where drafts live on the request between steps):

    1. verify    ONE packed target forward over everything: prefills, chunks, plain decodes and
                 each speculating request's last token + its stored drafts (num_new_tokens =
                 1 + k), with logits at all k+1 positions of the speculating ones
    2. accept    the rejection sampler keeps a prefix of each request's drafts and adds one token
                 (``minibatch.spec.rejection_sampler``); greedy: accept while equal to the argmax;
                 n-gram drafts (no q): accept while equal to the target's own sample
                 (``sample_verify``)
    3. propose   every row that sampled and goes on gets k drafts for its next step (a draft
                 model: k batched draft forwards; or n-gram lookup: no forward); the result
                 carries them, the scheduler's update stores them on the request, and the next
                 schedule() verifies them like any new tokens under the token budget

Rejected positions were written to the KV cache; the scheduler's ``update`` rolls them back:
num_computed_tokens grows by 1 + accepted only, and blocks holding no computed token are freed.

Seeded sampling (``SamplingParams.seed``): greedy requests and requests speculating with n-gram
drafts (``spec_ngram``) get the tokens a non-speculative run gives, whatever k, batch or
preemptions. With a draft model (``spec``) a seeded request's tokens depend on the schedule (k,
which positions were verified against drafts, preemptions), though a run is reproducible and
every schedule samples exactly the target's distribution (``minibatch.spec.rejection_sampler``).
"""

from __future__ import annotations

import time

import torch

from minibatch.runner.batch import build_packed_batch
from minibatch.runner.sampler import step_logprobs
from minibatch.scheduler.output import SchedulerOutput, StepResult
from minibatch.spec.proposers import DraftInput
from minibatch.spec.rejection_sampler import greedy_verify, processed_probs, rejection_sample, sample_verify
from minibatch.spec.speculator import FixedK, SpecDecodingStats, rows_to_draft


class SpeculativeRunner:
    """An executor: a target :class:`~minibatch.runner.ModelRunner` plus a proposer.

    Args:
        target: ModelRunner of the target model (its outputs are what requests get).
        proposer: :class:`~minibatch.spec.proposers.DraftModelProposer` or
            :class:`~minibatch.spec.proposers.NgramProposer`.
        speculator: :class:`~minibatch.spec.speculator.FixedK` (default k = 4) or
            :class:`~minibatch.spec.speculator.AdaptiveK`: k for each request's next drafts.

    Attributes:
        rejection_sampler: the function that accepts drafts in sampled mode (``rejection_sample``;
            tests swap in ``naive_sample`` to see a wrong one fail).
        stats: :class:`~minibatch.spec.speculator.SpecDecodingStats` over every step so far.
        supports_min_tokens: False: verification would have to ban EOS at every drafted position, which it
            does not; ``Engine.add_request`` refuses ``min_tokens`` > 0 here.
    """

    supports_min_tokens = False

    def __init__(self, target, proposer, speculator=None):
        self.target = target
        self.proposer = proposer
        self.speculator = speculator if speculator is not None else FixedK(4)
        self.stats = SpecDecodingStats()
        self.draft_probs: dict[str, torch.Tensor] = {}  # request_id -> q of its stored drafts (k, vocab_size)
        self.eos_token_ids = target.eos_token_ids
        self.max_model_len = target.max_model_len
        self.vocab_size = target.vocab_size
        self.rejection_sampler = rejection_sample

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.target.allocate_kv_cache(num_blocks, block_size, num_cpu_blocks)
        self.proposer.allocate_kv_cache(num_blocks, block_size, num_cpu_blocks)

    def claim(self, owner, kv_geometry: tuple[int, int, int] | None = None) -> bool:
        """The target's and the draft's KV caches go to ``owner`` (see ``KVOwnership.claim``)."""
        changed = self.target.claim(owner, kv_geometry)
        return self.proposer.claim(owner, kv_geometry) or changed

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step: verify the drafts the plan carries, sample, then propose the next drafts.

        Raises:
            ValueError: a padded plan (``out.is_padded_batch``, static batching): speculation needs a packed one.
            RuntimeError: the target's (or a draft model's) KV cache is not allocated ("call allocate_kv_cache...").
        """
        if out.is_padded_batch:
            raise ValueError("speculative decoding needs a packed (paged) scheduler, not static batching")
        self.target.move_blocks(out)
        self.proposer.move_blocks(out)  # the draft's KV lives in the same block ids
        for rid in out.preempted:
            self.proposer.reset(rid)
            self.draft_probs.pop(rid, None)
        t0 = time.perf_counter()
        packed = build_packed_batch(out, self.target._kv(), self.target.attention_backend)
        logits, rids = self.target.forward_packed(packed)
        sampled, accepted, rows_of = self._verify(out, logits, rids)
        logprobs = step_logprobs(logits, rows_of, {s.request_id: s.request.sampling for s in out.scheduled})
        t1 = time.perf_counter()
        batch = self._draft_inputs(out, sampled, accepted)
        proposals = self.proposer.propose(batch) if batch else {}
        t2 = time.perf_counter()
        for s in out.scheduled:  # drafts proposed now replace the ones just verified
            self.draft_probs.pop(s.request_id, None)
        self.draft_probs.update({rid: p for rid, (_, p) in proposals.items() if p is not None})
        if accepted:
            self.stats.verify_time_s += t1 - t0
        if batch:
            self.stats.draft_time_s += t2 - t1
        return StepResult(sampled=sampled, num_accepted=accepted,
                          spec_token_ids={rid: tuple(t) for rid, (t, _) in proposals.items() if t},
                          draft_forwards=tuple(self.proposer.forwards) if batch else (),
                          draft_time_s=t2 - t1 if batch else 0.0, logprobs=logprobs)

    def _verify(self, out: SchedulerOutput, logits: torch.Tensor, rids: list[str]):
        """Sample plain rows; accept a prefix of each verifying row's drafts. Returns (request_id ->
        emitted tokens, request_id -> accepted drafts for verifying rows, request_id -> (its first logits row,
        its emitted tokens) for ``step_logprobs``)."""
        sampled: dict[str, tuple[int, ...]] = {}
        accepted: dict[str, int] = {}
        rows_of: dict[str, tuple[int, tuple[int, ...]]] = {}  # first logits row, the tokens emitted from it on
        by_id = {s.request_id: s for s in out.scheduled}
        row = 0
        while row < len(rids):
            s = by_id[rids[row]]
            n, r, drafts = 1 + s.num_spec_tokens, s.request, list(s.spec_token_ids)
            if not drafts:
                tokens = [self.target.sampler.sample(r.request_id, logits[row], r.sampling)]
            elif r.sampling.is_greedy:
                tokens = greedy_verify(logits[row:row + n].argmax(-1).tolist(), drafts)
            elif r.request_id not in self.draft_probs:  # n-gram drafts: the target samples as plain decodes do
                rows, sample = logits[row:row + n], self.target.sampler.sample
                tokens = sample_verify(drafts, lambda i: sample(r.request_id, rows[i], r.sampling))
            else:  # the scheduler may have cut the drafts to the token budget: their first q rows
                gen = self.target.sampler.generator(r.request_id, r.sampling, logits.device)
                tokens = self.rejection_sampler(processed_probs(logits[row:row + n], r.sampling), drafts,
                                                self.draft_probs[r.request_id][:len(drafts)], gen)
            sampled[r.request_id] = tuple(tokens)
            rows_of[r.request_id] = (row, sampled[r.request_id])  # token i came from row + i
            if drafts:
                accepted[r.request_id] = len(tokens) - 1
                self.stats.observe(len(drafts), len(tokens) - 1)
            row += n
        return sampled, accepted, rows_of

    def _draft_inputs(self, out: SchedulerOutput, sampled: dict, accepted: dict) -> list[DraftInput]:
        """Who drafts for the next step, and how many: every row that sampled and goes on
        (``num_next_drafts``); a draft model also stops at the lookahead slots its block table holds."""
        batch = []
        for s, k in rows_to_draft(out, sampled, accepted, self.speculator):
            tokens = s.request.all_token_ids + list(sampled[s.request_id])
            table = out.block_tables[s.request_id]
            if self.proposer.writes_kv:
                k = min(k, len(table) * self.target.kv_cache.shape[3] - len(tokens) + 1)
            if k > 0:
                batch.append(DraftInput(s.request, tokens, k, table))
        return batch

    def make_stats(self) -> dict:
        """The drafts proposed and accepted ("spec_decoding", once any was proposed)."""
        return self.stats.make_stats()

    def observe_step(self, record) -> None:
        """The speculator learns the draft's cost (and AdaptiveK the pooled alpha) from each step."""
        self.speculator.observe_step(record)

    def free(self, request_ids: list[str]) -> None:
        self.target.free(request_ids)
        for rid in request_ids:
            self.proposer.reset(rid)
            self.draft_probs.pop(rid, None)
