"""The ``cpp`` attention backend (CPU): ``sdpa`` for prefills, and decodes by a C++ paged-attention kernel
(``minibatch.kernels.cpu_decode``) that reads each request's K/V through its block table in place: no padded copy
of the context, fp32 scores and softmax, one task per request on torch's threads. vLLM's PagedAttention decode
(Kwon et al., SOSP'23, §4.1) as a CPU loop nest.

The kernel is compiled the first time the backend is used on a machine (a C++ compiler with OpenMP and ninja;
tens of seconds, then cached); without them the backend is refused with the build error, and ``sdpa`` remains.
"""

from __future__ import annotations

from minibatch.kernels import cpu_decode
from minibatch.runner.attention import AttentionMetadata
from minibatch.runner.backends.base import register_backend
from minibatch.runner.backends.sdpa import SdpaAttentionData, SdpaBackend


class CppBackend(SdpaBackend):
    name = "cpp"
    description = "sdpa for prefills; decodes by a C++ paged-attention kernel reading K/V by block table (CPU)"
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

    def decode(self, q, k_cache, v_cache, data: SdpaAttentionData, scale: float, window: int | None):
        return cpu_decode.paged_decode(q, k_cache, v_cache, data.decode_tables, data.decode_lens, scale, window)


register_backend(CppBackend())
