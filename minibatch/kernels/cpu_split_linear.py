"""A CPU linear layer with its output features split across threads, in C++ (``cpu_split_linear.cpp``), built on
first use (``kernels.cpp_build``). Used by ``runner.prepack.split_linears`` for float32 decode steps."""

from __future__ import annotations

import os

import torch

from minibatch.kernels.cpp_build import CppExtension

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_split_linear.cpp")
KERNEL = CppExtension(SOURCE, "the C++ split linear kernel")
MIN_COLS = 128  # no slice narrower than this (a thread's start-up would cost more than its share)


def available() -> bool:
    """Whether the kernel is built (or can be built now) on this machine."""
    return KERNEL.available()


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 min_cols: int = MIN_COLS) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the output features split into one slice per torch thread (each at least
    ``min_cols`` wide), each slice's product run by its own thread. x: (m, k); weight: (n, k); bias: (n,) or None;
    CPU tensors of one dtype. Returns (m, n).

    Raises:
        RuntimeError: the kernel could not be built, or the shapes/dtypes break the contract (the C++ check's
            message)."""
    kernel = KERNEL.load().split_linear
    # a named range: the products run on the pool's threads, which torch's profiler does not see, so without it
    # ``python -m minibatch profile`` would count their time as Python overhead
    with torch.profiler.record_function("minibatch::split_linear"):
        return kernel(x, weight, bias, int(min_cols))
