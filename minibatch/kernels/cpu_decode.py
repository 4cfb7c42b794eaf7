"""A CPU paged decode-attention kernel in C++ (``cpu_paged_decode.cpp``), built on first use.

Eager torch has no paged-attention op: the ``sdpa`` backend copies each decode's K/V blocks into a padded tensor,
then runs the fused attention, whose CPU kernel is tuned for long query blocks, not the ``group`` (= num_heads /
num_kv_heads) query rows of a decode. This kernel is vLLM's PagedAttention decode (Kwon et al., SOSP'23, §4.1)
as a loop nest: one task per (request, KV head) reads that head's keys and values through the block table once,
for all its query heads, with fp32 scores and softmax. ``benchmarks/cpu_decode.py`` times it against the sdpa path.

It is compiled by ``torch.utils.cpp_extension.load`` (a C++ compiler with OpenMP; ninja) into torch's extension
cache the first time it is used on a machine (tens of seconds), then loaded from there. ``available()`` says
whether that worked; the error is kept for the message.
"""

from __future__ import annotations

import hashlib
import os
import platform

import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_paged_decode.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_module = None
_error: str | None = None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def build_name(source: str = SOURCE) -> str:
    """The extension's name: the source, flags, torch version and CPU model hashed (``-march=native`` code is
    only valid on the CPU it was built for, so another CPU sharing the cache builds its own)."""
    with open(source, "rb") as f:
        key = f.read() + " ".join(CFLAGS + [torch.__version__, platform.machine(), _cpu_model()]).encode()
    return "minibatch_paged_decode_" + hashlib.sha256(key).hexdigest()[:12]


def build(source: str = SOURCE):
    """Compile ``source`` (this kernel, or another version of it for an A/B) into torch's extension cache, or load
    it from there; returns the module. Raises whatever the build raises."""
    from torch.utils.cpp_extension import load as load_extension

    return load_extension(build_name(source), [source], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                          verbose=False)


def load():
    """The compiled extension module (built the first time on this machine).

    Raises:
        RuntimeError: it could not be built (no compiler, no OpenMP, ...); the message gives the first line of why.
    """
    global _module, _error
    if _module is None and _error is None:
        try:
            _module = build()
        except Exception as e:  # noqa: BLE001 - any build failure makes the backend unavailable, with its reason
            _error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    if _module is None:
        raise RuntimeError(f"the C++ paged decode kernel could not be built: {_error}")
    return _module


def available() -> bool:
    """Whether the kernel is built (or can be built now) on this machine."""
    try:
        load()
        return True
    except RuntimeError:
        return False


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Decode attention over the paged cache, on a CPU. q: (n, num_heads, head_dim); k_cache, v_cache:
    (num_blocks, block_size, num_kv_heads, head_dim), contiguous; tables: (n, max_blocks) int64; seq_lens: (n,)
    int64 (1 <= seq_len <= max_blocks x block_size); window: None or a sliding window (the last ``window`` keys).
    Returns (n, num_heads, head_dim) in q's dtype; fp32 softmax. Same contract as ``backends.compiled.paged_decode``.

    Raises:
        RuntimeError: the kernel could not be built, or the shapes/dtypes break the contract (the C++ check's
            message)."""
    kernel = load().paged_decode
    # a named range, so torch's profiler (``python -m minibatch profile``) credits the kernel's time to attention
    with torch.profiler.record_function("minibatch::paged_decode"):
        return kernel(q, k_cache, v_cache, tables, seq_lens, float(scale), int(window or 0))
