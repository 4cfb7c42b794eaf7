"""The ``cpp`` attention backend (CPU): C++ kernels that read each request's K/V through its block table in place.

* Decodes: a paged-attention kernel (``minibatch.kernels.cpu_decode``): no padded copy of the context, fp32 scores
  and softmax, one task per request on torch's threads. vLLM's PagedAttention decode (Kwon et al., SOSP'23, §4.1)
  as a CPU loop nest.
* Prefills: a paged prefill kernel (``minibatch.kernels.cpu_prefill``): FlashAttention's tiling (Dao et al.,
  NeurIPS'22, §3.1) over the whole context, cached and new, all the step's prefills in one call; bf16 on VDPBF16PS
  (CPUs with AVX512-BF16), float32 on fused multiply-adds (AVX2 with FMA, or AVX-512). Elsewhere (bf16 without
  AVX512-BF16, float16, CPUs without AVX2) prefills run ``sdpa``'s path.

The kernels are compiled the first time the backend is used on a machine (a C++ compiler with OpenMP and ninja;
tens of seconds each, then cached); without them the backend is refused with the build error, and ``sdpa``
remains (a prefill kernel that does not build leaves the prefills on ``sdpa``'s path).
"""

from __future__ import annotations

import torch

from minibatch.kernels import cpu_decode, cpu_prefill
from minibatch.runner.attention import AttentionMetadata
from minibatch.runner.backends.base import register_backend
from minibatch.runner.backends.sdpa import SdpaAttentionData, SdpaBackend


class CppBackend(SdpaBackend):
    name = "cpp"
    description = ("C++ paged-attention kernels reading K/V by block table: decodes, and prefills in float32 "
                   "(AVX2) or bf16 (AVX512-BF16; else sdpa's prefill path) (CPU)")
    devices = ("cpu",)

    def check(self, device, dtype, block_size=None) -> None:
        """As ``AttentionBackend.check``, and the kernel must build on this machine.

        Raises:
            ValueError: the device, dtype or block_size is not supported, or the kernel cannot be built (the
                message says why)."""
        super().check(device, dtype, block_size)
        try:
            cpu_decode.load()
        except RuntimeError as e:
            raise ValueError(f"attention_backend 'cpp' is not available here: {e}; use 'sdpa'") from None

    decode_mask = False  # the kernel masks by data.decode_lens

    def prepare(self, m: AttentionMetadata) -> None:
        super().prepare(m)
        if m.decode_indices:
            data: SdpaAttentionData = m.data
            data.decode_tables = data.decode_tables.contiguous()

    def prepare_prefills(self, m: AttentionMetadata, data: SdpaAttentionData) -> None:
        """The prefills' spans for the prefill kernel where it takes this cache and every new token's K/V is written
        to it (else ``sdpa``'s masks): one row [first query row, query rows, seq_len, block-table row] per prefill."""
        if not (data.write_all and cpu_prefill.supports(m.kv_cache)):
            return super().prepare_prefills(m, data)
        data.prefill_spans = torch.tensor([[m.cu_seqlens_q[i], m.cu_seqlens_q[i + 1] - m.cu_seqlens_q[i],
                                            m.seq_lens[i], i] for i in m.prefill_indices])
        data.prefill_tables = m.block_tables.contiguous()

    def prefill(self, m: AttentionMetadata, layer: int, q, k, v, scale: float, window: int | None, out) -> None:
        data: SdpaAttentionData = m.data
        if data.prefill_spans is None:  # prepare_prefills built sdpa's masks instead
            return super().prefill(m, layer, q, k, v, scale, window, out)
        cpu_prefill.paged_prefill(q.contiguous(), m.kv_cache[layer, 0], m.kv_cache[layer, 1], data.prefill_tables,
                                  data.prefill_spans, scale, window, out)

    def decode(self, q, k_cache, v_cache, data: SdpaAttentionData, scale: float, window: int | None):
        return cpu_decode.paged_decode(q, k_cache, v_cache, data.decode_tables, data.decode_lens, scale, window)


register_backend(CppBackend())
