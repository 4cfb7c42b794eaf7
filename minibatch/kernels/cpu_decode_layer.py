"""A Llama-family decoder layer's decode path in one C++ call (``cpu_decode_layer.cpp``) on a CPU: float32 on our
packed kernels (:func:`decode_layer`), bf16 on oneDNN's prepacked products (:func:`decode_layer_prepacked`).

A decode step of a small model spends much of its time outside the matrix products and attention: ~40 small
operators per layer (RMSNorm's six, rotary embedding's dozen, residual adds, SiLU, views), each microseconds of
dispatch on a few thousand numbers. This kernel runs the whole layer (RMSNorm, q/k/v projections, rotary, the K/V
write, paged decode attention, o projection, residual, RMSNorm, SiLU-gated MLP, residual) in one call, with the
packed matrix product (``kernels.cpu_linear``) and the paged decode kernel (``kernels.cpu_decode``) linked in. The
runner side is ``runner.fused_layers``. vLLM's and SGLang's model code exists for the same reason (fewer, larger
operations per layer); here it is a loop nest over transformers' own weights, not a second model definition.

Built on first use from the seven sources (``kernels.cpp_build``), then loaded from torch's extension cache.
"""

from __future__ import annotations

import os

import torch

from minibatch.kernels.cpp_build import CppExtension

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(_HERE, "cpu_decode_layer.cpp")
KERNEL = CppExtension(SOURCE, "the C++ fused decode layer",
                      extra_sources=tuple(os.path.join(_HERE, f)
                                          for f in ("cpu_linear.cpp", "cpu_paged_decode.cpp", "cpu_amx_linear.cpp",
                                                    "cpu_bf16_linear.cpp", "cpu_paged_prefill.cpp",
                                                    "cpu_argmax.cpp")),
                      extra_cflags=("-DMINIBATCH_KERNEL_LIBRARY",))


def available() -> bool:
    """Whether the kernel is built (or can be built now) on this machine."""
    return KERNEL.available()


def decode_layer(x: torch.Tensor, norms: list, eps: list, panels: list, biases: list, dims: list,
                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 window: int | None) -> torch.Tensor:
    """One decoder layer for n one-token decodes. x: (n, hidden) float32, the residual stream; norms: the input and
    post-attention RMSNorm weights (hidden,), eps their epsilons; panels: q, k, v, o, gate, up, down weights packed by
    ``kernels.cpu_linear.pack_weight``; biases: q, k, v, o biases or None; dims: (hidden, intermediate, num_heads,
    num_kv_heads, head_dim); cos, sin: (n, head_dim) float32 from the model's rotary module; k_cache, v_cache: the
    layer's (num_blocks, block_size, num_kv_heads, head_dim) float32 caches (the new K/V are written at
    slot_mapping (n,) int64, -1 = not written); tables (n, max_blocks) int64 and seq_lens (n,) int64 as
    ``kernels.cpu_decode.paged_decode``'s; window: None or the sliding window. Returns (n, hidden) float32.

    Raises:
        RuntimeError: the kernel could not be built, or the shapes/dtypes break the contract (the C++ check's
            message)."""
    return KERNEL.load().decode_layer(x, norms, eps, panels, *biases, dims, cos, sin, k_cache, v_cache, slot_mapping,
                                      tables, seq_lens, float(scale), int(window or 0))


def decode_layer_prepacked(x: torch.Tensor, norms: list, eps: list, weights: list, biases: list, kernel_rows: list,
                           dims: list, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor, tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int | None, spans: torch.Tensor | None = None,
                           prefill_tables: torch.Tensor | None = None,
                           decode_rows: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`decode_layer` for a bf16 model whose linears are prepacked for oneDNN (``runner.prepack``): the
    operators transformers' modules run, in their order and dtype, called from C++ (outputs bit for bit the
    modules'). x: (n, hidden) bf16; weights: the fused q/k/v product's, o_proj's, the fused gate/up product's and
    down_proj's prepacked weights; biases: the q/k/v product's and o_proj's, or None; kernel_rows: [amx_rows,
    bf16_rows], products of at most amx_rows rows run ``kernels.cpu_amx_linear``, else of at most bf16_rows rows
    ``kernels.cpu_bf16_linear``, on the same prepacked weights, as the modules' do in the engine's steps
    (``runner.prepack.prepacked_product``; 0: none); cos, sin: (n, head_dim) in x's dtype; caches in x's dtype; the
    rest as :func:`decode_layer`'s. A step with rows of several tokens (prefills, chunks, verifications) passes
    ``spans`` and ``prefill_tables`` as ``kernels.cpu_prefill.paged_prefill``'s (their attention runs that kernel)
    and ``decode_rows`` ((d,) int64: the one-token rows, whose ``tables`` and ``seq_lens`` are then those d rows',
    or None). Returns (n, hidden) in x's dtype.

    Raises:
        RuntimeError: the kernel could not be built, or the shapes/dtypes break the contract."""
    return KERNEL.load().decode_layer_prepacked(x, norms, eps, weights, *biases, *map(int, kernel_rows), dims, cos,
                                                sin, k_cache, v_cache, slot_mapping, tables, seq_lens, float(scale),
                                                int(window or 0), spans, prefill_tables, decode_rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama's, Mistral's, Qwen2's) in bf16 as one call, the bf16 layer's own: bit for bit the
    module's output (its mean is torch's on the same float32 squares; the elementwise steps round as torch's
    kernels do). x: (n, d) bf16 CPU; weight: (d,) bf16. Returns (n, d) bf16.

    Raises:
        RuntimeError: the kernel could not be built, or the shapes/dtypes are not these."""
    return KERNEL.load().rms_norm_like_modules(x, weight, float(eps))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """``torch.argmax(logits, -1)``, the same indices (the first of tied maxima; the first NaN, which counts as the
    largest), in one vectorized pass per row (``cpu_argmax.cpp``), for the sampler's greedy rows. logits: (rows,
    vocab) float32 or bf16 on the CPU with contiguous rows. Returns (rows,) int64, or None where it does not apply:
    another dtype, device or layout, a build without AVX-512 (its scalar loop is slower than torch's), or this
    extension not built in this process (it never starts a build: the ``cpp`` attention backend builds it)."""
    module = KERNEL.module
    if (module is None or logits.dim() != 2 or logits.device.type != "cpu" or logits.stride(-1) != 1
            or logits.dtype not in (torch.float32, torch.bfloat16) or not module.greedy_argmax_vectorized()):
        return None
    return module.greedy_argmax(logits)
