"""Selective batching (Orca, Yu et al. OSDI'22, §3.2) on a real model, for notebook 03: one packed
(num_tokens,) forward through our runner (linear layers on every token at once, attention split per
request and merged) vs one padded (B, T) forward with HF's SDPA and a mask, timed and compared."""

from __future__ import annotations

import time
from typing import Callable

import torch

from minibatch.models import attention_implementation, pad_token_id
from minibatch.request import Request, SamplingParams
from minibatch.runner import attention
from minibatch.runner.batch import build_packed_batch
from minibatch.scheduler.base import SchedulerOutput
from minibatch.scheduler.output import ScheduledRequest


def prefill_output(prompts: list[list[int]], block_size: int = 16) -> SchedulerOutput:
    """A hand-built SchedulerOutput: every prompt as a whole prefill ("req-0", "req-1", ...), each
    with its own contiguous run of KV blocks (block ids 0, 1, ... in order). Allocate at least
    ``num_blocks_used(out)`` blocks of ``block_size`` before running it."""
    scheduled, block_tables, next_block = [], {}, 0
    for i, ids in enumerate(prompts):
        r = Request(f"req-{i}", list(ids), max_new_tokens=1, sampling=SamplingParams(ignore_eos=True))
        n = -(-len(ids) // block_size)  # blocks for the prompt, rounded up
        block_tables[r.request_id] = list(range(next_block, next_block + n))
        next_block += n
        scheduled.append(ScheduledRequest(r, len(ids), "prefill", row=i))
    return SchedulerOutput(scheduled=scheduled, block_tables=block_tables)


def num_blocks_used(out: SchedulerOutput) -> int:
    """Smallest KV cache (in blocks) that holds every block id of ``out.block_tables``."""
    return 1 + max(b for bt in out.block_tables.values() for b in bt)


@torch.inference_mode()
def packed_forward(runner, out: SchedulerOutput) -> torch.Tensor:
    """One packed (1, num_tokens) forward of ``out`` with selective batching: the runner's own
    ``build_packed_batch`` and split/merge attention (``runner.kv_cache`` must be allocated).

    Unlike ``ModelRunner.execute`` it returns logits for *every* token, (num_tokens, vocab_size),
    in packed order, so they can be compared token by token.
    """
    if runner.kv_cache is None:
        raise RuntimeError("call runner.allocate_kv_cache(num_blocks, block_size) first")
    batch = build_packed_batch(out, runner.kv_cache)
    with attention_implementation(runner.model, attention.ATTN_IMPLEMENTATION):
        return runner.model(input_ids=batch.input_ids[None], position_ids=batch.positions[None],  # (1, num_tokens)
                            attn_metadata=batch.attn_metadata, logits_to_keep=0, use_cache=False).logits[0]


def packed_logits(runner, prompts: list[list[int]], block_size: int = 16) -> torch.Tensor:
    """:func:`packed_forward` of ``prompts`` as one prefill step (see :func:`prefill_output`), with
    a KV cache just big enough allocated first. Returns (num_tokens, vocab_size) logits."""
    out = prefill_output(prompts, block_size)
    runner.allocate_kv_cache(num_blocks_used(out), block_size)
    return packed_forward(runner, out)


@torch.inference_mode()
def padded_forward(model, prompts: list[list[int]]) -> torch.Tensor:
    """One padded (B, T) forward, T = the longest prompt, with HF's SDPA attention and a mask.

    Prompts are right-padded here (position p of row i is token p of prompt i, so real tokens
    are ``logits[i, :len(prompt_i)]``); the static engine left-pads instead, so that every row's
    last token lines up for decoding. The padding count is the same.
    Returns logits (B, T, vocab_size), padding rows included.
    """
    max_len = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), max_len), pad_token_id(model), dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(prompts), max_len), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    with attention_implementation(model, "sdpa"):
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (B, T, vocab_size)


def unpad(padded_logits: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The real tokens' rows of a right-padded (B, T, V) tensor, in packed order: (sum(lens), V)."""
    return torch.cat([padded_logits[i, :n] for i, n in enumerate(lens)])


def time_forwards(fns: dict[str, Callable[[], torch.Tensor]],
                  repeats: int = 3) -> dict[str, tuple[float, torch.Tensor]]:
    """Best-of-``repeats`` wall time (s) of each ``fn()``, and its result from the last call.

    The functions run in interleaved rounds (a, b, a, b, ...), so that a burst of load from other
    processes on a shared CPU slows both rather than just one of them.
    """
    best = {name: float("inf") for name in fns}
    results = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            results[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: (best[name], results[name]) for name in fns}


@torch.inference_mode()
def next_token_alone(model, requests: list[Request]) -> dict[str, int]:
    """Greedy next token of each request run alone (HF SDPA, one unpadded forward of all its
    tokens, no cache): the reference a batched step must reproduce."""
    with attention_implementation(model, "sdpa"):
        return {r.request_id: int(model(input_ids=torch.tensor([r.all_token_ids]), use_cache=False,
                                        logits_to_keep=1).logits[0, -1].argmax()) for r in requests}
