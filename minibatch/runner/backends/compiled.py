"""The ``compiled`` attention backend: ``sdpa``, with its decode attention written as plain tensor math and
compiled by ``torch.compile`` (inductor) into one kernel that reads K/V through the block table.

Eager torch has no paged-attention op, so the ``sdpa`` backend first copies every decode's K/V blocks into a padded
(num_decodes, max_blocks x block_size, ...) tensor and then attends: the copy reads and writes all of it once more.
Written as gather -> scores -> masked softmax -> weighted sum, inductor fuses the gather into the reductions (the
loads index the cache through the block table directly), so no padded copy is made: vLLM's PagedAttention decode
kernel (Kwon et al., SOSP'23, §4.1), generated instead of hand-written. Scores and softmax are fp32.

The first step with two or more decodes compiles it (seconds; a C++ compiler is needed on a CPU, Triton on CUDA);
shapes are dynamic, so later steps reuse the kernel (``experiment.warm_up`` runs such a step before timed runs).
Prefills run as in ``sdpa``.
"""

from __future__ import annotations

import torch

from minibatch.runner.attention import AttentionMetadata
from minibatch.runner.backends.base import register_backend
from minibatch.runner.backends.sdpa import SdpaAttentionData, SdpaBackend

_compiled = None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Decode attention over the paged cache. q: (n, num_heads, head_dim); k_cache, v_cache: (num_blocks,
    block_size, num_kv_heads, head_dim); tables: (n, max_blocks) int64; seq_lens: (n,) int64. Returns (n,
    num_heads, head_dim) in q's dtype. GQA: the ``group`` query heads of a KV head share its keys."""
    n, num_heads, d = q.shape
    h_kv = k_cache.shape[2]
    # (n, h_kv, L, d): under torch.compile these are loads indexed through the table, not a copy
    k = k_cache[tables].flatten(1, 2).transpose(1, 2).float()
    v = v_cache[tables].flatten(1, 2).transpose(1, 2).float()
    qg = q.view(n, h_kv, num_heads // h_kv, 1, d).float()
    scores = (qg * k[:, :, None]).sum(-1) * scale  # (n, h_kv, group, L): softmax along the contiguous axis
    pos = torch.arange(k.shape[2], device=q.device)[None, :]
    hidden = pos >= seq_lens[:, None]  # (n, L): past the context
    if window is not None:
        hidden = hidden | (pos < seq_lens[:, None] - window)
    probs = torch.softmax(scores.masked_fill(hidden[:, None, None, :], float("-inf")), dim=-1)
    out = (probs[..., None] * v[:, :, None]).sum(-2)  # (n, h_kv, group, d)
    return out.reshape(n, num_heads, d).to(q.dtype)


def compiled_paged_decode():
    """``paged_decode`` compiled once per process (dynamic shapes). Sizes that happen to be equal when it compiles
    (say 2 decodes and the cache's K/V axis of 2) are not assumed equal later ("duck sizing" off), so a new batch
    never recompiles it."""
    global _compiled
    if _compiled is None:
        from torch.fx.experimental import _config as fx_config

        compiled = torch.compile(paged_decode, dynamic=True)

        def run(*args):
            with fx_config.patch(use_duck_shape=False):
                return compiled(*args)

        _compiled = run
    return _compiled


class CompiledBackend(SdpaBackend):
    name = "compiled"
    description = "sdpa, with decode attention compiled (torch.compile) to read K/V through the block table"

    def prepare(self, m: AttentionMetadata) -> None:
        super().prepare(m)
        if m.decode_indices:
            data: SdpaAttentionData = m.data
            data.decode_groups = length_groups(data.decode_lens, data.decode_tables, m.kv_cache.shape[3])

    def decode(self, q, k_cache, v_cache, data: SdpaAttentionData, scale: float, window: int | None):
        if len(data.decode_groups) == 1:
            return self._decode(q, k_cache, v_cache, data.decode_tables, data.decode_lens, scale, window)
        out = torch.empty_like(q)
        for rows, tables, lens in data.decode_groups:
            out[rows] = self._decode(q[rows], k_cache, v_cache, tables, lens, scale, window)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, tables, lens, scale, window):
        # sizes of 1 would be specialised by the compiler (and recompiled at the first real batch): run them eagerly
        fn = paged_decode if min(tables.shape) < 2 else compiled_paged_decode()
        return fn(q, k_cache, v_cache, tables, lens, scale, window)


def length_groups(lens: torch.Tensor, tables: torch.Tensor, block_size: int, min_rows: int = 8) -> list:
    """Split decodes into a short and a long half by context length, each with its block tables cut to its own
    longest context, so short contexts are not padded to the longest one (the kernel computes every padded
    position). Returns [(rows, tables, lens)], one group when there are fewer than 2 x ``min_rows`` decodes or
    splitting saves under 15% of the padded positions."""
    n = lens.shape[0]
    if n < 2 * min_rows:
        return [(None, tables, lens)]
    order = torch.argsort(lens)
    half = n // 2
    groups = [order[:half], order[half:]]
    blocks = [-(-int(lens[g].max()) // block_size) for g in groups]
    if sum(len(g) * b for g, b in zip(groups, blocks)) > 0.85 * n * tables.shape[1]:
        return [(None, tables, lens)]
    return [(g, tables[g, :b].contiguous(), lens[g]) for g, b in zip(groups, blocks)]


register_backend(CompiledBackend())
