"""Proposers: where speculative decoding's draft tokens come from.

* :class:`NgramProposer` -- prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` method): no
  model at all. Find the latest earlier occurrence of the request's last n tokens in its own
  tokens (prompt and output) and propose the k tokens that followed it. Strong when the output
  copies from the input (summaries, code edits, extraction), free when it finds nothing.
* :class:`DraftModelProposer` -- a small causal LM with the target's tokenizer (Leviathan et al.
  2023; Chen et al. 2023) runs k autoregressive steps per verification, batched over every
  speculating request through its own :class:`~minibatch.runner.ModelRunner` and KV cache.

Proposers run after the target's step has sampled (vLLM v1's order): each gets, per request, its
tokens including the ones just sampled (:class:`DraftInput`) and proposes the next step's drafts.

The draft's KV cache has the target's geometry in blocks (same num_blocks and block_size, its
own layers and heads), so a request's ``block_table`` addresses both caches: one block manager
serves two models, as in vLLM. The scheduler reserves lookahead slots past a sampling row's new
tokens, where the draft writes the K/V of the tokens it feeds beyond the target's. The draft
keeps, per request, how many leading positions of its cache are valid: those below the request's
last token (the target keeps their blocks; the lookahead blocks are freed after the step). Each
proposal first catches up on the tokens it has not seen (the prompt, the accepted drafts, the
bonus token) in the same forward as its first draft step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from minibatch.request import Request
from minibatch.runner.batch import PackedSequence
from minibatch.runner.sampler import Sampler
from minibatch.scheduler.output import SchedulerOutput
from minibatch.spec.rejection_sampler import processed_probs


@dataclass(frozen=True)
class DraftInput:
    """One request to draft for: its ``token_ids`` after this step (prompt, outputs and the tokens
    just sampled; the drafts continue them), ``k`` drafts wanted (>= 1), and its ``block_table``."""

    request: Request
    token_ids: list[int]
    k: int
    block_table: tuple[int, ...]

    @property
    def request_id(self) -> str:
        return self.request.request_id


def ngram_lookup(token_ids: list[int], k: int, n_max: int = 4, n_min: int = 1) -> list[int]:
    """Prompt lookup: for n = n_max .. n_min, find the latest earlier occurrence of the last n
    tokens and return (up to) the k tokens that followed it; [] if no n-gram recurs.

    Example: tokens ``a b c d a b`` with k = 2 -> ``c d`` (the bigram ``a b`` occurred at 0).

    Raises:
        ValueError: k < 0 or not 1 <= n_min <= n_max.
    """
    if k < 0 or not 1 <= n_min <= n_max:
        raise ValueError(f"need k >= 0 and 1 <= n_min <= n_max, got k={k}, n_min={n_min}, n_max={n_max}")
    L = len(token_ids)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = token_ids[L - n:]
        for start in range(L - n - 1, -1, -1):  # latest match first; it must have a token after it
            if token_ids[start:start + n] == suffix:
                return list(token_ids[start + n:start + n + k])
    return []


class NgramProposer:
    """Prompt lookup decoding (no model). n_max, n_min: the n-gram sizes tried, longest first.

    Raises:
        ValueError: not 1 <= n_min <= n_max (checked by ``ngram_lookup``).
    """

    name = "ngram"
    writes_kv = False  # drafts need no KV of their own: no lookahead slots

    def __init__(self, n_max: int = 4, n_min: int = 1):
        ngram_lookup([], 0, n_max, n_min)  # validates
        self.n_max, self.n_min = n_max, n_min
        self.forwards: list[tuple[int, int, int]] = []  # no draft forwards, ever

    def propose(self, batch: list[DraftInput]) -> dict[str, tuple[list[int], None]]:
        """request_id -> (draft tokens, at most k; maybe none, None): deterministic proposals have no distribution."""
        return {d.request_id: (ngram_lookup(d.token_ids, d.k, self.n_max, self.n_min), None) for d in batch}

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        pass

    def claim(self, owner, kv_geometry: tuple[int, int, int] | None = None) -> bool:
        return False  # no KV cache of its own

    def move_blocks(self, out: SchedulerOutput) -> None:
        pass

    def reset(self, request_id: str) -> None:
        pass


class DraftModelProposer:
    """k autoregressive draft steps per verification on a small model, batched over requests.

    Args:
        runner: a :class:`~minibatch.runner.ModelRunner` on the draft model (same tokenizer as
            the target: same vocab_size).

    Each request samples its drafts from the draft's *processed* distribution (its
    temperature/top-k/top-p; argmax when greedy) with its own seeded generator, and returns that
    distribution for the rejection sampler. The generator restarts from its seed after a
    preemption (``reset``): one reason a seeded request's tokens under a draft model depend on the
    schedule (``minibatch.spec.rejection_sampler``). ``forwards`` holds each draft forward of the last
    ``propose`` as (rows, tokens, context tokens), for simulated clocks.
    """

    name = "draft"
    writes_kv = True  # writes the draft's K/V for the tokens it feeds (lookahead slots)

    def __init__(self, runner):
        self.runner = runner
        self.num_computed: dict[str, int] = {}  # request_id -> leading positions of draft KV that are valid
        self.sampler = Sampler()  # the drafts' own generators (the target's stay untouched)
        self.forwards: list[tuple[int, int, int]] = []  # (rows, tokens, context) of the last propose

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.runner.allocate_kv_cache(num_blocks, block_size, num_cpu_blocks)

    def claim(self, owner, kv_geometry: tuple[int, int, int] | None = None) -> bool:
        """The draft runner's KV cache goes to ``owner``; if it changed hands, no draft KV is trusted."""
        changed = self.runner.claim(owner, kv_geometry)
        if changed:
            self.num_computed.clear()
        return changed

    def move_blocks(self, out: SchedulerOutput) -> None:
        self.runner.move_blocks(out)

    def reset(self, request_id: str) -> None:
        """Forget the request's draft KV (after a preemption or when it finishes)."""
        self.num_computed.pop(request_id, None)
        self.sampler.free([request_id])

    def _draw(self, r: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if r.sampling.is_greedy:
            return int(logits.argmax()), None
        probs = processed_probs(logits, r.sampling)
        gen = self.sampler.generator(r.request_id, _draft_params(r), logits.device)
        return int(torch.multinomial(probs, 1, generator=gen)), probs

    @torch.inference_mode()
    def propose(self, batch: list[DraftInput]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """request_id -> (draft tokens (k), their distributions (k, vocab_size) or None if greedy)."""
        tokens = {d.request_id: [] for d in batch}
        probs: dict[str, list[torch.Tensor]] = {d.request_id: [] for d in batch}
        by_id = {d.request_id: d for d in batch}
        seqs = []
        for d in batch:  # first forward: catch up on unseen tokens, up to the last one (position c)
            c = len(d.token_ids) - 1
            valid = min(self.num_computed.get(d.request_id, 0), c)
            seqs.append(PackedSequence(d.request_id, d.token_ids[valid:c + 1], valid, list(d.block_table), 1))
        self.forwards = []
        while seqs:
            self.forwards.append((len(seqs), sum(len(q.token_ids) for q in seqs),
                                  sum(q.start + len(q.token_ids) for q in seqs)))
            logits, rids = self.runner.forward_sequences(seqs)  # (len(seqs), vocab_size)
            nxt = []
            for row, (seq, rid) in enumerate(zip(seqs, rids)):
                d = by_id[rid]
                tok, p = self._draw(d.request, logits[row])
                tokens[rid].append(tok)
                if p is not None:
                    probs[rid].append(p)
                if len(tokens[rid]) < d.k:  # feed the draft token to get the next one
                    nxt.append(PackedSequence(rid, [tok], seq.start + len(seq.token_ids), seq.block_table, 1))
            seqs = nxt
        for d in batch:  # valid: below the last token (the lookahead slots are freed after the step)
            self.num_computed[d.request_id] = len(d.token_ids) - 1
        return {rid: (tokens[rid], torch.stack(probs[rid]) if probs[rid] else None) for rid in tokens}


def _draft_params(r: Request):
    """The draft's sampling stream: the request's params with a derived seed (so draft and
    target draws are independent but reproducible); no seed stays no seed (a random stream)."""
    if r.sampling.seed is None:
        return r.sampling
    return dataclasses.replace(r.sampling, seed=(r.sampling.seed * 1_000_003 + 17) % (1 << 63))
