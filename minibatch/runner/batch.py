"""Turn a SchedulerOutput into the flat tensors of one packed (num_tokens,) forward.

This is the only place that builds model inputs for selective batching (nano-vllm's
``prepare_prefill`` / ``prepare_decode``, merged: a prefill is many new tokens, a decode is one,
so one code path serves both and any mix of them).

For request i with num_computed_tokens = c and num_new_tokens = n (seq_len = c + n):

    positions      c, c+1, ..., c+n-1                      (its new tokens)
    context slots  block_table[p // block_size] * block_size + p % block_size,  p = 0 .. seq_len-1
    slot_mapping   the context slots of its new tokens (where their K/V are written)

All requests' context slots come from one (num_reqs, max_seq_len) table, built with a few
tensor ops whatever the batch size:

    block_tables (padded)      positions p            context_slots[i, p]
    req0: [7, 2, 9, 0]         0 1 2 3 4 5 ...        7*bs+0 7*bs+1 ... 2*bs+0 ...
    req1: [4, 0, 0, 0]         0 1 2 ...              4*bs+0 4*bs+1 ...  (cut at seq_len)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minibatch.runner.attention import AttentionMetadata, context_slots
from minibatch.runner.backends import AttentionBackend, get_backend
from minibatch.scheduler.base import SchedulerOutput


@dataclass
class PackedBatch:
    """input_ids, positions: (num_tokens,) int64. logits_indices: (num_logits,) int64, the packed
    index of each position that returns logits (a sampling request's last token; all k+1
    positions of a speculative verification); sample_request_ids names the request of each."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    sample_request_ids: list[str]
    attn_metadata: AttentionMetadata


def block_table_tensor(block_tables: list[list[int]], seq_lens: list[int], block_size: int) -> torch.Tensor:
    """(num_reqs, max_blocks) int64: each request's block_table, cut to the blocks its seq_len
    uses and right-padded with block 0.

    Raises:
        ValueError: a block_table too short for its seq_len (it would alias another request's KV).
    """
    max_blocks = -(-max(seq_lens) // block_size)
    rows = []
    for i, (bt, seq_len) in enumerate(zip(block_tables, seq_lens)):
        if len(bt) * block_size < seq_len:
            raise ValueError(f"block_table of request {i} holds {len(bt)} blocks, {seq_len} tokens need more")
        rows.append([*bt[:max_blocks]] + [0] * (max_blocks - len(bt)))
    return torch.tensor(rows, dtype=torch.long).view(len(rows), max_blocks)  # one tensor: a step's only table op


def context_slot_table(block_tables: list[list[int]], seq_lens: list[int], block_size: int) -> torch.Tensor:
    """(num_reqs, max_seq_len) int64: the cache slot of every context position of every request;
    positions at or past a request's seq_len hold slot 0 (masked out by the caller)."""
    return context_slots(block_table_tensor(block_tables, seq_lens, block_size), seq_lens, block_size)


@dataclass
class PackedSequence:
    """One request's share of a packed forward: ``token_ids`` at positions start, start+1, ...
    (start = its num_computed_tokens), written to the slots its ``block_table`` gives;
    ``num_logits`` trailing positions return logits (0: none, 1: sample the next token,
    k+1: speculative verification)."""

    request_id: str
    token_ids: list[int]
    start: int
    block_table: list[int]
    num_logits: int


def build_packed_batch(out: SchedulerOutput, kv_cache: torch.Tensor,
                       backend: str | AttentionBackend = "torch") -> PackedBatch:
    """Pack all scheduled tokens of ``out`` into one row. kv_cache: (L, 2, num_blocks, block_size, H_kv, D).

    A request scheduled with draft tokens (``ScheduledRequest.spec_token_ids``, speculative
    decoding) feeds its last token plus the k draft tokens and returns logits at all k+1 positions.

    Raises:
        ValueError: a request is scheduled for more tokens than it has.
    """
    seqs = []
    for s in out.scheduled:
        r = s.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids)
        if end > r.num_tokens:
            raise ValueError(f"request {r.request_id!r}: {end} tokens scheduled, only {r.num_tokens} known")
        known = r.prompt_token_ids if end <= r.num_prompt_tokens else r.all_token_ids
        ids = known[start:end] + list(s.spec_token_ids)
        num_logits = 1 + len(s.spec_token_ids) if end == r.num_tokens else 0  # reaches its last token: sample
        seqs.append(PackedSequence(r.request_id, ids, start, out.block_tables[r.request_id], num_logits))
    return pack_sequences(seqs, kv_cache, backend)


def pack_sequences(seqs: list[PackedSequence], kv_cache: torch.Tensor,
                   backend: str | AttentionBackend = "torch") -> PackedBatch:
    """The flat tensors of one packed forward over ``seqs`` (see the module docstring).

    backend: an attention backend or its registered name (``runner.backends``); its ``prepare`` adds what
    it needs to the common metadata (the torch reference: each request's context slots; the Triton
    kernels: int32 block tables). ``logits_indices`` lists, sequence by sequence, the packed index of
    each position that returns logits; ``sample_request_ids`` names the sequence of each.
    """
    device = kv_cache.device
    block_size = kv_cache.shape[3]
    ids, positions, seq_lens, cu_seqlens_q, logits_indices, sample_ids = [], [], [], [0], [], []
    for seq in seqs:
        n = len(seq.token_ids)
        ids += seq.token_ids
        positions += range(seq.start, seq.start + n)
        seq_lens.append(seq.start + n)
        cu_seqlens_q.append(cu_seqlens_q[-1] + n)
        logits_indices += range(cu_seqlens_q[-1] - seq.num_logits, cu_seqlens_q[-1])
        sample_ids += [seq.request_id] * seq.num_logits
    tables = [seq.block_table for seq in seqs]
    bt = block_table_tensor(tables, seq_lens, block_size).to(device)  # (num_reqs, max_blocks)
    # each new token's slot from the (checked) block tables, in Python: a decode step's few tokens would cost
    # microseconds per tensor op (a 1024-token prefill's list ~0.1 ms)
    slots = [seq.block_table[p // block_size] * block_size + p % block_size
             for seq in seqs for p in range(seq.start, seq.start + len(seq.token_ids))]
    meta = AttentionMetadata(
        kv_cache=kv_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        block_tables=bt,
        prefill_indices=[i for i, seq in enumerate(seqs) if len(seq.token_ids) > 1],
        decode_indices=[i for i, seq in enumerate(seqs) if len(seq.token_ids) == 1],
        backend=get_backend(backend),
    )
    meta.backend.prepare(meta)  # the backend's own metadata, once per step
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        sample_request_ids=sample_ids,
        attn_metadata=meta,
    )
