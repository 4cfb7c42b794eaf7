"""A float32 linear layer for a CPU in C++ (``cpu_linear.cpp``), built on first use (``kernels.cpp_build``).

The weight is packed once into panels of 16 output features (:func:`pack_weight`) and every call runs a
register-tiled micro-kernel over them (GotoBLAS / BLIS: Goto and van de Geijn, "Anatomy of High-Performance Matrix
Multiplication", ACM TOMS 2008, §4-6). Why: torch's float32 ``F.linear`` on a CPU calls MKL's GEMM, which packs the
weight again at every call and, for the few rows of a decode step, runs far below the CPU's peak (a GEMV on one
core at one row). ``benchmarks/cpu_linear.py`` times the two on SmolLM2-135M's layer shapes and in decode steps.

Numbers: each output is the bias plus the products summed in input-feature order with fused multiply-adds, the
same for any row count or thread count (a request's output does not depend on its batch); not bit-identical to
``F.linear``, whose MKL sums in another order. ``runner.prepack.pack_linears`` uses it inside the engine's steps
only (:func:`runner.prepack.engine_linears`), so the Hugging Face reference and baselines keep running stock
``F.linear``.
"""

from __future__ import annotations

import os

import torch

from minibatch.kernels.cpp_build import CppExtension

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_linear.cpp")
KERNEL = CppExtension(SOURCE, "the C++ float32 linear kernel")
PANEL = 16  # output features per panel (the kernel's constant)


def available() -> bool:
    """Whether the kernel is built (or can be built now) on this machine."""
    return KERNEL.available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight (out_features, in_features), float32 on the CPU, as the kernel's panels:
    (ceil(out_features / 16), in_features, 16), zeros past out_features. A copy: the model's weight is unchanged.

    Raises:
        RuntimeError: the kernel could not be built, or ``weight`` is not a 2-D float32 CPU tensor."""
    return KERNEL.load().pack_weight(weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` from :func:`pack_weight`'s panels. x: (..., in_features) float32 CPU; bias:
    (out_features,) or None. Returns (..., out_features) float32. The call is named ``minibatch::packed_linear``
    in torch's profiler.

    Raises:
        RuntimeError: the kernel could not be built, or the shapes/dtypes break the contract (the C++ check's
            message)."""
    return KERNEL.load().packed_linear(x, packed, out_features, bias)
