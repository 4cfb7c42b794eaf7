"""The ``triton`` attention backend: the paged-attention kernels of ``minibatch.kernels`` (vLLM's
PagedAttention, Kwon et al., SOSP'23 §4.1) read K/V through the block tables themselves; on a CPU they run in
Triton's interpreter (TRITON_INTERPRET=1), on CUDA compiled. No sliding window.

An all-decode step runs the decode kernel; a step with any prefill runs every request through the prefill
kernel (q_len 1 included). On CUDA, all-decode steps can be recorded as CUDA graphs (``runner.cuda_graphs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minibatch.runner.attention import AttentionMetadata
from minibatch.runner.backends.base import AttentionBackend, register_backend


@dataclass
class TritonAttentionData:
    """The kernels' tables, int32: block_tables (num_reqs, max_blocks), seq_lens (num_reqs,), cu_seqlens_q
    (num_reqs + 1,)."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor


class TritonBackend(AttentionBackend):
    name = "triton"
    description = "paged-attention Triton kernels reading the block tables (interpreted on a CPU)"
    cuda_graphs = True  # the kernels read tables and lengths on the GPU and loop over each context there

    def graph_data(self, block_tables, seq_lens, cu_seqlens_q) -> TritonAttentionData:
        return TritonAttentionData(block_tables, seq_lens, cu_seqlens_q)

    def prepare(self, m: AttentionMetadata) -> None:
        device = m.block_tables.device
        m.data = TritonAttentionData(m.block_tables.to(torch.int32),
                                     torch.tensor(m.seq_lens, dtype=torch.int32, device=device),
                                     torch.tensor(m.cu_seqlens_q, dtype=torch.int32, device=device))

    def forward(self, m: AttentionMetadata, layer: int, q, k, v, scale: float, window: int | None) -> torch.Tensor:
        from minibatch import kernels

        data: TritonAttentionData = m.data
        kernels.store_kv(m.kv_cache, layer, k, v, m.slot_mapping)
        if not m.prefill_indices:
            return kernels.paged_decode_attention(q, m.kv_cache, layer, data.block_tables, data.seq_lens, scale)
        max_q_len = max(b - a for a, b in zip(m.cu_seqlens_q, m.cu_seqlens_q[1:]))
        return kernels.paged_prefill_attention(q, m.kv_cache, layer, data.block_tables, data.seq_lens,
                                               data.cu_seqlens_q, scale, max_q_len)


register_backend(TritonBackend())
