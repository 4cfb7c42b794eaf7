"""The C++ kernels a ModelRunner will load, built in the background while a command loads its model."""

from __future__ import annotations

import torch

from minibatch.kernels import cpp_build


def start_kernel_builds(device, dtype, attention_backend: str):
    """Start building, on a background thread (``kernels.cpp_build.build_in_background``), the C++ kernels a
    ModelRunner on ``device`` with ``attention_backend`` may build on first use for a model in ``dtype`` (a torch
    dtype or a ``--dtype`` name, "auto" included), in the order it loads them: the packed linears' for float32 on a
    CPU (the AMX linear's for bf16 on a CPU with AMX, else the AVX512-BF16 linear's where the CPU has that), then
    the ``cpp`` backend's decode kernel and the fused decode layer's, then its prefill kernel's for float32, or for
    bf16 where the CPU has AVX512-BF16 (none on a GPU, or without a C++ compiler).
    Returns the thread, to ``join()`` before anything is timed."""
    from minibatch.kernels import cpu_amx_linear, cpu_bf16_linear, cpu_decode, cpu_decode_layer, cpu_linear, cpu_prefill
    from minibatch.precision import resolve_dtype

    on_cpu = torch.device(device).type == "cpu" and cpp_build.compiler_available()
    float32 = on_cpu and resolve_dtype(dtype, device) == torch.float32
    bf16 = on_cpu and resolve_dtype(dtype, device) == torch.bfloat16
    amx = bf16 and cpu_amx_linear.cpu_has_amx()
    avx512_bf16 = bf16 and not amx and cpu_bf16_linear.cpu_has_avx512_bf16()
    cpp = on_cpu and attention_backend == "cpp"
    prefill = cpp and (float32 or bf16 and cpu_bf16_linear.cpu_has_avx512_bf16())  # the paged prefill kernel's dtypes
    return cpp_build.build_in_background(([cpu_linear.KERNEL] if float32 else [])
                                         + ([cpu_amx_linear.KERNEL] if amx else [])
                                         + ([cpu_bf16_linear.KERNEL] if avx512_bf16 else [])
                                         + ([cpu_decode.KERNEL, cpu_decode_layer.KERNEL] if cpp else [])
                                         + ([cpu_prefill.KERNEL] if prefill else []))
