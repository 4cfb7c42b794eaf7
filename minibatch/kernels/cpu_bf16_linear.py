"""A bf16 linear layer with AVX512-BF16 for a decode step's few rows (``cpu_bf16_linear.cpp``) on CPUs without AMX,
reading the weight that oneDNN prepacked (``runner.prepack``) in place, built on first use (``kernels.cpp_build``).

Why: at the 1-64 rows of a decode step a product is one pass over its weight. oneDNN's matmul spends 20-30
microseconds per call before it starts and streams a cold weight at well under the memory's speed; this kernel
starts in a few and walks each weight once, prefetching the next block of 64 output features
(``benchmarks/bf16_linear.py``, ``data/cpu/bf16_linear.json``: the linears of SmolLM2-135M's 30 layers and whole
decode steps, both ways). It reads oneDNN's own layout on such CPUs (AB16b64a2b: blocks of 64 output features, the
input features in VNNI pairs), checked byte for byte by :func:`layout_ok` before a layer uses it, so there is no
second copy of the weights. Each output is its row's pairs summed in order over all of k (VDPBF16PS); oneDNN adds
per-block sums over k instead, so about one output in 10^4 differs in the last bf16 bit: the engine uses the kernel
only inside its own steps (``runner.prepack.engine_linears``), where the fused decode layers and the modules both run
it, and the modules elsewhere (the Hugging Face reference, the baselines) keep oneDNN's outputs, bit for bit
``F.linear``'s. Intel, "Intel Architecture Instruction Set Extensions Programming Reference", VDPBF16PS.
"""

from __future__ import annotations

import functools
import os

import torch

from minibatch.kernels.cpp_build import CppExtension

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_bf16_linear.cpp")
KERNEL = CppExtension(SOURCE, "the C++ AVX512-BF16 linear kernel")
BF16_MAX_ROWS = 64  # products of more rows (prefills) run oneDNN's matmul, which blocks large products well


@functools.cache
def cpu_has_avx512_bf16() -> bool:
    """Whether this Linux CPU reports AVX512-BF16 (``avx512_bf16`` in /proc/cpuinfo, read once): nothing is built
    elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in f)
    except OSError:
        return False


def layout_ok(packed: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`bf16_linear` can run ``packed`` (``torch.ops.mkldnn._reorder_linear_weight(weight, hint)``)
    here: the CPU has AVX512-BF16, the kernel builds, and ``packed`` holds ``weight`` ((n, k) bf16) in the layout the
    kernel reads. False, never an error, where any of that fails (the caller keeps oneDNN)."""
    return (packed.is_mkldnn and weight.dtype == torch.bfloat16 and cpu_has_avx512_bf16() and KERNEL.available()
            and bool(KERNEL.load().bf16_layout_ok(packed, weight)))


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` from the prepacked ``packed`` (see :func:`layout_ok`). x: (m, in_features) bf16 CPU;
    bias: (out_features,) bf16 or None. Returns (m, out_features) bf16. Named ``minibatch::bf16_linear`` in torch's
    profiler.

    Raises:
        RuntimeError: the kernel could not be built, this CPU has no AVX512-BF16, or the shapes/dtypes break the
            contract (the C++ check's message)."""
    return KERNEL.load().bf16_linear(x, packed, out_features, bias)
