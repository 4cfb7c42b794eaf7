"""A bf16 linear layer on Intel AMX for a decode step's few rows (``cpu_amx_linear.cpp``), reading the weight that
oneDNN prepacked (``runner.prepack``) in place, built on first use (``kernels.cpp_build``).

Why: on a 2-core Xeon with AMX, oneDNN's matmul streamed a decode step's weights at well under the memory's speed
and spent tens of microseconds per call before starting; this kernel walks each weight once with software
prefetches and starts in a few (``benchmarks/amx_linear.py``, ``data/cpu/amx_linear.json``: the call overhead, and
SmolLM2-135M's linears and decode steps both ways). It reads oneDNN's own blocked layout
(AB16b32a2b: 32 x 32 blocks of VNNI pairs), checked byte for byte by :func:`layout_ok` before a layer uses it, so
there is no second copy of the weights. Up to :data:`AMX_MAX_ROWS` rows its outputs matched oneDNN's bit for bit
on every shape tried (``tests/test_amx_linear.py``); above that oneDNN blocks the sums differently and is faster,
so the callers keep it there. Intel, "Intel Architecture Instruction Set Extensions Programming Reference",
chapter 3 (AMX).
"""

from __future__ import annotations

import os

import torch

from minibatch.kernels.cpp_build import CppExtension

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_amx_linear.cpp")
KERNEL = CppExtension(SOURCE, "the C++ AMX bf16 linear kernel")
AMX_MAX_ROWS = 32  # products of more rows (prefills, big decode batches) run oneDNN's matmul


def cpu_has_amx() -> bool:
    """Whether torch reports AMX tiles on this CPU (nothing is built where it does not)."""
    return getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()


def layout_ok(packed: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`amx_linear` can run ``packed`` (``torch.ops.mkldnn._reorder_linear_weight(weight, hint)``)
    here: the CPU has AMX, the kernel builds, the OS grants the tile state, and ``packed`` holds ``weight`` ((n, k)
    bf16) in the layout the kernel reads. False, never an error, where any of that fails (the caller keeps oneDNN)."""
    return (cpu_has_amx() and packed.is_mkldnn and weight.dtype == torch.bfloat16 and KERNEL.available()
            and bool(KERNEL.load().amx_layout_ok(packed, weight)))


def amx_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` from the prepacked ``packed`` (see :func:`layout_ok`). x: (m, in_features) bf16 CPU;
    bias: (out_features,) bf16 or None. Returns (m, out_features) bf16. Named ``minibatch::amx_linear`` in torch's
    profiler.

    Raises:
        RuntimeError: the kernel could not be built, this CPU has no AMX, or the shapes/dtypes break the contract
            (the C++ check's message)."""
    return KERNEL.load().amx_linear(x, packed, out_features, bias)
