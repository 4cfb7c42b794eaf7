"""Numeric precision of a run: the torch dtype a ``--dtype`` name stands for, and what ``auto`` picks.

Weights, activations and the KV cache are held in the run's dtype; softmax and the logits a token is
sampled from are computed in float32 (``runner.attention``, ``runner.sampler``). bfloat16 halves the
bytes of every weight and KV slot, so a step reads half the memory and a KV budget in bytes holds
twice the tokens; where the hardware multiplies bf16 natively (CUDA GPUs since Ampere, x86 CPUs with
AVX512-BF16 or AMX) a step is also faster. Elsewhere bf16 is emulated and slower than float32, so
``auto`` keeps float32 there. float16 is offered for GPUs; CPUs emulate most of its arithmetic.

Reduced precision changes outputs: a packed batch and a request run alone round differently, so
greedy near-ties can flip (see ``minibatch.equivalence`` for the rule reference checks use then).
"""

from __future__ import annotations

import torch

DTYPES = ("float32", "bfloat16", "float16", "auto")
REDUCED_PRECISION = (torch.bfloat16, torch.float16)


def cpu_has_fast_bf16() -> bool:
    """True if this CPU multiplies bfloat16 natively (x86 AVX512-BF16 or AMX tiles), as torch reports it."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def resolve_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype of ``name`` (one of ``DTYPES``, or a torch dtype, returned as is) on ``device``.

    ``auto`` is bfloat16 where it is fast -- CUDA with ``torch.cuda.is_bf16_supported()``, a CPU with
    :func:`cpu_has_fast_bf16` -- else float32.

    Raises:
        ValueError: ``name`` is not one of ``DTYPES`` (the message names ``--dtype`` and the choices).
    """
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name != "auto":
        return getattr(torch, name)
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the name ``--dtype`` takes and results record."""
    return str(dtype).removeprefix("torch.")


def is_reduced(dtype: torch.dtype) -> bool:
    """bfloat16 or float16: outputs are checked with the logprob-close rule, not token equality."""
    return dtype in REDUCED_PRECISION
