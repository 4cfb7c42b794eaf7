"""SpeculativeRunner: speculative decoding inside continuous batching.

One engine step, for the scheduler's plan (Leviathan et al. 2023, Algorithm 1, batched):

    1. propose   every request the scheduler gave k > 0 draft slots gets up to k draft tokens
                 (a draft model: k batched draft forwards; or n-gram lookup: no forward)
    2. verify    ONE packed target forward over everything: prefills, chunks, plain decodes and
                 each speculating request's last token + drafts (num_new_tokens = 1 + k), with
                 logits at all k+1 positions of the speculating ones
    3. accept    the rejection sampler keeps a prefix of each request's drafts and adds one token
                 (``minibatch.spec.rejection_sampler``); greedy: accept while equal to the argmax;
                 n-gram drafts (no q): accept while equal to the target's own sample
                 (``sample_verify``)

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
from minibatch.scheduler.base import SchedulerOutput
from minibatch.spec.rejection_sampler import greedy_verify, processed_probs, rejection_sample, sample_verify
from minibatch.spec.speculator import FixedK, SpecDecodingStats


class SpeculativeRunner:
    """An executor: a target :class:`~minibatch.runner.ModelRunner` plus a proposer.

    Args:
        target: ModelRunner of the target model (its outputs are what requests get).
        proposer: :class:`~minibatch.spec.proposers.DraftModelProposer` or
            :class:`~minibatch.spec.proposers.NgramProposer`.
        speculator: :class:`~minibatch.spec.speculator.FixedK` (default k = 4) or
            :class:`~minibatch.spec.speculator.AdaptiveK`; give the same object to the scheduler.

    Attributes:
        rejection_sampler: the function that accepts drafts in sampled mode (``rejection_sample``;
            tests swap in ``naive_sample`` to see a wrong one fail).
        stats: :class:`~minibatch.spec.speculator.SpecDecodingStats` over every step so far.
    """

    def __init__(self, target, proposer, speculator=None):
        self.target = target
        self.proposer = proposer
        self.speculator = speculator if speculator is not None else FixedK(4)
        self.stats = SpecDecodingStats()
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
    def execute(self, out: SchedulerOutput) -> dict[str, int | list[int]]:
        """Run one step; returns request_id -> token (plain rows) or list of tokens (rows that
        verified drafts: the accepted drafts, then one more)."""
        if out.is_padded_batch:
            raise ValueError("speculative decoding needs a packed (paged) scheduler, not static batching")
        self.target.move_blocks(out)
        self.proposer.move_blocks(out)  # the draft's KV lives in the same block ids
        for rid in out.preempted:
            self.proposer.reset(rid)
        specs = [s for s in out.scheduled if s.num_spec_tokens > 0]
        t0 = time.perf_counter()
        drafts = self.proposer.propose(out, specs) if specs else {}
        t1 = time.perf_counter()
        for s in specs:
            s.spec_token_ids = list(drafts[s.request_id][0])
            s.num_new_tokens = 1 + len(s.spec_token_ids)  # a proposer may find fewer than k
        out.draft_time_s = t1 - t0
        out.draft_forwards = list(self.proposer.forwards) if specs else []
        logits, rids = self.target.forward_packed(build_packed_batch(out, self.target._kv(), self.target.attention_backend))
        t2 = time.perf_counter()
        result: dict[str, int | list[int]] = {}
        by_id = {s.request_id: s for s in out.scheduled}
        row = 0
        while row < len(rids):
            s = by_id[rids[row]]
            n = 1 + len(s.spec_token_ids)
            r = s.request
            if not s.spec_token_ids:
                result[r.request_id] = self.target.sampler.sample(r.request_id, logits[row], r.sampling)
            else:
                rows = logits[row:row + n]
                if r.sampling.is_greedy:
                    tokens = greedy_verify(rows.argmax(-1).tolist(), s.spec_token_ids)
                elif drafts[r.request_id][1] is None:  # n-gram drafts: the target samples as plain decodes do
                    sample = self.target.sampler.sample
                    tokens = sample_verify(s.spec_token_ids, lambda i: sample(r.request_id, rows[i], r.sampling))
                else:
                    gen = self.target.sampler.generator(r.request_id, r.sampling, rows.device)
                    tokens = self.rejection_sampler(processed_probs(rows, r.sampling), s.spec_token_ids,
                                              drafts[r.request_id][1], gen)
                result[r.request_id] = tokens
                self.stats.observe(len(s.spec_token_ids), len(tokens) - 1)
                self.speculator.observe(r.request_id, len(s.spec_token_ids), len(tokens) - 1)
            row += n
        if specs:  # (the speculator learns step costs from the engine's records: scheduler.observe_step)
            self.stats.draft_time_s += t1 - t0
            self.stats.verify_time_s += t2 - t1
        return result

    def free(self, request_ids: list[str]) -> None:
        self.target.free(request_ids)
        for rid in request_ids:
            self.proposer.reset(rid)
            self.speculator.free(rid)
