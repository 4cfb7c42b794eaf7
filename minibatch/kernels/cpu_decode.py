"""A CPU paged decode-attention kernel in C++ (``cpu_paged_decode.cpp``), built on first use.

Eager torch has no paged-attention op: the ``sdpa`` backend copies each decode's K/V blocks into a padded tensor,
then runs the fused attention, whose CPU kernel is tuned for long query blocks, not the ``group`` (= num_heads /
num_kv_heads) query rows of a decode. This kernel is vLLM's PagedAttention decode (Kwon et al., SOSP'23, §4.1)
as a loop nest: one task per (request, KV head) reads that head's keys and values through the block table once,
for all its query heads, with fp32 scores and softmax (a bf16 cache's scores on AMX tiles where the CPU has them:
``cpu_paged_bf16.h``). ``benchmarks/cpu_decode.py`` times it against the sdpa path.

It is compiled the first time it is used on a machine (``kernels.cpp_build``: tens of seconds), then loaded from
torch's extension cache. ``available()`` says whether that worked; the error is kept for the message.
"""

from __future__ import annotations

import os

import torch

from minibatch.kernels.cpp_build import CppExtension, build  # noqa: F401 (build: the benchmark's A/B)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_paged_decode.cpp")
KERNEL = CppExtension(SOURCE, "the C++ paged decode kernel")


def load():
    """The compiled extension module (built the first time on this machine).

    Raises:
        RuntimeError: it could not be built (no compiler, no OpenMP, ...); the message gives the first line of why.
    """
    return KERNEL.load()


def available() -> bool:
    """Whether the kernel is built (or can be built now) on this machine."""
    return KERNEL.available()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Decode attention over the paged cache, on a CPU. q: (n, num_heads, head_dim); k_cache, v_cache:
    (num_blocks, block_size, num_kv_heads, head_dim), contiguous; tables: (n, max_blocks) int64; seq_lens: (n,)
    int64 (1 <= seq_len <= max_blocks x block_size); window: None or a sliding window (the last ``window`` keys).
    Returns (n, num_heads, head_dim) in q's dtype; fp32 softmax. Same contract as ``backends.compiled.paged_decode``.

    Raises:
        RuntimeError: the kernel could not be built, or the shapes/dtypes break the contract (the C++ check's
            message)."""
    # named minibatch::paged_decode in torch's profiler (by the C++), which credits its time to attention
    return load().paged_decode(q, k_cache, v_cache, tables, seq_lens, float(scale), int(window or 0))
