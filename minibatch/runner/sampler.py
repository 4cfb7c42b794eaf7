"""Next-token choice from logits: greedy, or temperature -> top-k -> top-p, then a seeded draw.

The order follows Hugging Face's logits warpers (temperature, top-k, top-p). Each request draws
from its own ``torch.Generator`` seeded with ``SamplingParams.seed``, kept until the request
finishes (a preemption keeps it), one draw per sampled token: its samples depend neither on which
other requests share the batch nor on the policy. Speculative verification keeps that for n-gram
drafts (``spec.rejection_sampler.sample_verify`` calls ``sample`` once per emitted token), not
for a draft model's (see ``minibatch.spec.rejection_sampler``).
"""

from __future__ import annotations

import secrets

import torch

from minibatch.kernels import cpu_decode_layer
from minibatch.request import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to (vocab_size,) logits; filtered entries get -inf."""
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # keep the smallest set reaching top_p
        drop[0] = False  # and always the most likely token (a top_p below float32's smallest step would drop all)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def ban_tokens(logits: torch.Tensor, banned: list[tuple[int, ...]]) -> torch.Tensor:
    """``logits`` (num_rows, vocab_size) with row i's ``banned[i]`` token ids set to -inf (a copy; the same tensor
    when nothing is banned): what ``SamplingParams.min_tokens`` does before a request's first min_tokens tokens
    (vLLM's min-tokens logits processor). Logprobs are still taken from the raw logits."""
    if not any(banned):
        return logits
    cols = [t for ids in banned for t in ids if t < logits.shape[-1]]
    rows = [i for i, ids in enumerate(banned) for t in ids if t < logits.shape[-1]]
    out = logits.clone()
    out[rows, cols] = float("-inf")
    return out


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_logprobs: list[int]) -> list[dict[int, float]]:
    """What ``SamplingParams.logprobs`` records for one emitted token per row.

    logits: (num_rows, vocab_size), the unprocessed logits each token was sampled from (any dtype);
    token_ids: the token sampled from each row; num_logprobs: how many of the most likely tokens each
    row keeps. Returns per row {token id: logprob}: its top tokens and its sampled token, log_softmax
    computed in float32 (vLLM's raw logprobs: before temperature, top-k and top-p).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)  # (num_rows, vocab_size)
    k = max(num_logprobs, default=0)
    top = lp.topk(k, dim=-1) if k else None
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None])[:, 0].tolist()
    out = []
    for i, (t, n) in enumerate(zip(token_ids, num_logprobs)):
        row = dict(zip(top.indices[i, :n].tolist(), top.values[i, :n].tolist())) if n else {}
        row[int(t)] = chosen[i]
        out.append(row)
    return out


def step_logprobs(logits: torch.Tensor, rows: dict[str, tuple[int, tuple[int, ...]]], sampling: dict) -> dict:
    """``StepResult.logprobs`` of a step. logits: (num_rows, vocab_size), the step's sampled rows;
    rows: request_id -> (its first row, the tokens it emitted: token i from row first + i). For each
    request whose ``sampling[request_id].logprobs`` is set, one :func:`token_logprobs` dict per token;
    the other rows are not touched."""
    wanted = [rid for rid in rows if sampling[rid].logprobs is not None]
    if not wanted:
        return {}
    index = [rows[rid][0] + i for rid in wanted for i in range(len(rows[rid][1]))]
    tokens = [t for rid in wanted for t in rows[rid][1]]
    counts = [sampling[rid].logprobs for rid in wanted for _ in rows[rid][1]]
    flat = iter(token_logprobs(logits[index], tokens, counts))
    return {rid: tuple(next(flat) for _ in rows[rid][1]) for rid in wanted}


ARGMAX_CHUNK = 1024  # vocabulary entries per chunk in :func:`two_pass_argmax`


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of (rows, vocab_size) logits, the same indices (ties: the first; a NaN counts as the
    largest, as in ``torch.argmax``): on a CPU where the fused layers' extension is built with AVX-512 (the ``cpp``
    backend builds it), one vectorized pass per row (``kernels.cpu_decode_layer.greedy_argmax``), else
    :func:`two_pass_argmax`. Returns (rows,) int64."""
    fast = cpu_decode_layer.greedy_argmax(logits)
    return fast if fast is not None else two_pass_argmax(logits)


def two_pass_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``, the same indices, in two short passes on a CPU from 4 rows: the max of every chunk of
    ``ARGMAX_CHUNK`` entries (a vectorized reduction), then the argmax of the chunk maxima and, in the winning chunk,
    of its entries. Why: torch's CPU argmax over a whole row is a scalar loop (``data/cpu/greedy_argmax.json``: at 32
    rows of a 49152-entry vocabulary, float32, 0.28 ms against 1.00 ms; bf16, and the one-pass kernel, in
    ``data/cpu/greedy_argmax_bfloat16.json``). Returns (rows,) int64."""
    rows, vocab = logits.shape
    main = vocab - vocab % ARGMAX_CHUNK
    # a GPU's argmax is one fast kernel already; a row or two, or a short vocabulary, are quick either way
    if rows < 4 or main < 4 * ARGMAX_CHUNK or logits.device.type != "cpu":
        return logits.argmax(-1)
    n_chunks = main // ARGMAX_CHUNK
    chunks = logits[:, :main].reshape(rows, n_chunks, ARGMAX_CHUNK)
    tail = logits[:, main:]  # the last vocab % ARGMAX_CHUNK entries (maybe none), one more chunk
    maxima = chunks.amax(-1)
    if tail.shape[1]:
        maxima = torch.cat([maxima, tail.amax(-1, keepdim=True)], dim=1)
    best = maxima.argmax(-1)  # the first chunk holding the row's max (amax keeps a NaN)
    within = chunks[torch.arange(rows, device=logits.device), best.clamp(max=n_chunks - 1)].argmax(-1)
    if tail.shape[1]:
        within = torch.where(best == n_chunks, tail.argmax(-1), within)
    return best * ARGMAX_CHUNK + within


class Sampler:
    """Keeps one generator per request (by request_id) until ``free`` is called."""

    def __init__(self):
        self.generators: dict[str, torch.Generator] = {}

    def generator(self, request_id: str, params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
        """The request's generator, seeded with ``params.seed`` on first use (no seed: a fresh
        random one, without reseeding, and so without disturbing, torch's global generator)."""
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
            self.generators[request_id] = gen
        return gen

    def sample(self, request_id: str, logits: torch.Tensor, params: SamplingParams) -> int:
        """logits: (vocab_size,). Returns a token id."""
        if params.is_greedy:
            return int(torch.argmax(logits))
        gen = self.generator(request_id, params, logits.device)
        probs = filter_logits(logits.float(), params).softmax(-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    def sample_batch(self, request_ids: list[str], logits: torch.Tensor,
                     params: list[SamplingParams]) -> dict[str, int]:
        """logits: (num_requests, vocab_size), row i for ``request_ids[i]`` with ``params[i]``. Greedy rows share one
        argmax (:func:`greedy_tokens`). Returns request_id -> token id.

        Raises:
            ValueError: request_ids, params and the logits' rows are not equally many."""
        if not len(request_ids) == len(params) == logits.shape[0]:
            raise ValueError(f"sample_batch: {len(request_ids)} request_ids, {len(params)} params and "
                             f"{logits.shape[0]} logit rows must be equally many")
        greedy = greedy_tokens(logits).tolist()
        return {
            rid: greedy[i] if p.is_greedy else self.sample(rid, logits[i], p)
            for i, (rid, p) in enumerate(zip(request_ids, params))
        }

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)
