"""What machine this is: the CPU model and its vector instruction sets, read from /proc/cpuinfo.

Results record both (``report.environment``); the C++ kernels' build name covers both (``kernels.cpp_build``).
"""

from __future__ import annotations


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else platform.processor(), else "unknown"."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# Vector instruction sets our kernels and torch's pick their code by (x86 and Arm names, as /proc/cpuinfo spells them)
SIMD_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "asimdhp", "sve", "sve2", "bf16")


def cpu_isa() -> str:
    """This CPU's vector instruction sets among SIMD_FLAGS, space-separated in that order (Linux: the ``flags`` or
    ``Features`` line of /proc/cpuinfo); "" where unknown. Two machines can share a cpu_model string and differ
    here (a 2-core "AMD EPYC" with AVX-512 and bf16, and one with AVX2 only), which changes what a step costs and
    which code ``-march=native`` may emit."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
    have = set(line.split(":", 1)[1].split()) if ":" in line else set()
    return " ".join(flag for flag in SIMD_FLAGS if flag in have)
