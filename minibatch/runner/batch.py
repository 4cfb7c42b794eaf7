"""Turn a SchedulerOutput into the flat tensors of one packed (num_tokens,) forward.

This is the only place that builds model inputs for selective batching (nano-vllm's
``prepare_prefill`` / ``prepare_decode``, merged: a prefill is many new tokens, a decode is one,
so one code path serves both and any mix of them).

For a request with num_computed_tokens = c and num_new_tokens = n:

    positions      c, c+1, ..., c+n-1                      (its new tokens)
    slot_mapping   block_table[p // block_size] * block_size + p % block_size   for those p
    context_slots  the same formula for p = 0 .. c+n-1     (what its queries attend to)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minibatch.runner.attention import AttentionMetadata
from minibatch.scheduler.base import SchedulerOutput


@dataclass
class PackedBatch:
    """input_ids, positions: (num_tokens,) int64. logits_indices: (num_sampled,) int64, the packed
    index of each sampling request's last token; sample_request_ids names those requests."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    sample_request_ids: list[str]
    attn_metadata: AttentionMetadata


def slots_for_positions(block_table: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position: block_table[p // block_size] * block_size + p % block_size."""
    table = torch.tensor(block_table, dtype=torch.long, device=positions.device)
    return table[positions // block_size] * block_size + positions % block_size


def build_packed_batch(out: SchedulerOutput, kv_cache: torch.Tensor) -> PackedBatch:
    """Pack all scheduled tokens of ``out`` into one row. kv_cache: (L, 2, num_blocks, block_size, H_kv, D)."""
    device = kv_cache.device
    block_size = kv_cache.shape[3]
    ids, positions, slot_mapping, context_slots = [], [], [], []
    cu_seqlens_q, seq_lens, logits_indices, sample_ids = [0], [], [], []
    for s in out.scheduled:
        r = s.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        if end > r.num_tokens:
            raise ValueError(f"request {r.request_id!r}: {end} tokens scheduled, only {r.num_tokens} known")
        pos = torch.arange(0, end, device=device)  # (seq_len,)
        ctx = slots_for_positions(out.block_tables[r.request_id], pos, block_size)
        ids.append(torch.tensor(r.all_token_ids[start:end], dtype=torch.long))
        positions.append(pos[start:])
        slot_mapping.append(ctx[start:])
        context_slots.append(ctx)
        cu_seqlens_q.append(cu_seqlens_q[-1] + s.num_new_tokens)
        seq_lens.append(end)
        if end == r.num_tokens:  # the step reaches the request's last known token: sample the next one
            logits_indices.append(cu_seqlens_q[-1] - 1)
            sample_ids.append(r.request_id)
    decode_ids = [i for i, s in enumerate(out.scheduled) if s.num_new_tokens == 1]
    meta = AttentionMetadata(
        kv_cache=kv_cache,
        slot_mapping=torch.cat(slot_mapping),
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        context_slots=context_slots,
        decode_ids=decode_ids,
    )
    if decode_ids:  # right-pad the decodes' contexts into one (num_decodes, max_seq_len) table
        max_len = max(seq_lens[i] for i in decode_ids)
        meta.decode_slots = torch.zeros((len(decode_ids), max_len), dtype=torch.long, device=device)
        meta.decode_mask = torch.zeros((len(decode_ids), max_len), dtype=torch.bool, device=device)
        for row, i in enumerate(decode_ids):
            meta.decode_slots[row, : seq_lens[i]] = context_slots[i]
            meta.decode_mask[row, : seq_lens[i]] = True
    return PackedBatch(
        input_ids=torch.cat(ids).to(device),
        positions=torch.cat(positions),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        sample_request_ids=sample_ids,
        attn_metadata=meta,
    )
