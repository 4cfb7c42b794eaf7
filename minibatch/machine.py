"""What machine this is: the CPU model and its vector instruction sets, read from /proc/cpuinfo, and its last-level
caches' size (sysfs); how its C allocator treats the memory a step frees (``keep_freed_memory``); a KV cache on
2 MiB pages (``huge_page_zeros``); and a process-level helper for its native libraries' stderr
(``native_stderr_hidden``); whether a server can listen at an address here (``check_listen_address``).

Results record the CPU model, its family and model numbers, its instruction sets, the allocator's state and the KV
cache's pages (``report.environment``); the C++ kernels' build name covers the first three (``kernels.cpp_build``).
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch


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


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu") -> int:
    """The bytes of this machine's last-level caches, each distinct one once (Linux sysfs: every data or unified
    cache of the highest level, told apart by the CPUs sharing it), or 0 where unknown. A 2-core cloud slice can
    report its host's whole L3 (300 MiB on one Xeon here): what a "far larger than the caches" buffer must beat."""
    import glob

    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    caches: dict[tuple[int, str], int] = {}
    for index in glob.glob(os.path.join(root, "cpu[0-9]*", "cache", "index[0-9]*")):
        try:
            fields = {}
            for name in ("level", "type", "size", "shared_cpu_list"):
                with open(os.path.join(index, name)) as f:
                    fields[name] = f.read().strip()
            size = fields["size"]
            nbytes = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size)
            if fields["type"] != "Instruction":
                caches[(int(fields["level"]), fields["shared_cpu_list"])] = nbytes
        except (OSError, ValueError, KeyError):
            continue
    top = max((level for level, _ in caches), default=0)
    return sum(n for (level, _), n in caches.items() if level == top)


# Vector instruction sets our kernels and torch's pick their code by (x86 and Arm names, as /proc/cpuinfo spells them)
SIMD_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "asimdhp", "sve", "sve2", "bf16")


CPU_ID_FIELDS = (("cpu family", "family"), ("model", "model"), ("CPU implementer", "implementer"),
                 ("CPU part", "part"))  # /proc/cpuinfo's x86 and Arm names, and ours


def cpu_id(path: str = "/proc/cpuinfo") -> str:
    """The CPU's generation by number (Linux: "family 26 model 2" on x86, "implementer 0x41 part 0xd0c" on Arm, from
    the first processor of ``path``), "" where unknown. A cloud machine's model string can hide it: two 2-core
    "AMD EPYC"s with the same :func:`cpu_isa`, a Zen 4 (family 25) and a Zen 5 (family 26), differ in what a step
    costs (the bf16 matmul peaks that ``python -m minibatch profile`` measured on them: about 425 and 700 GFLOP/s,
    ``data/cpu/step_profile_decode32_runs_zen4_a86bd3d.json`` and
    ``data/cpu/step_profile_decode32_zen5_c329f76.json``)."""
    found: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block only
                key, _, value = line.partition(":")
                for field, name in CPU_ID_FIELDS:
                    if key.strip() == field:
                        found.setdefault(name, value.strip())
    except OSError:
        return ""
    return " ".join(f"{name} {found[name]}" for _, name in CPU_ID_FIELDS if name in found)


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


# glibc malloc settings that keep freed memory for reuse: blocks up to MMAP_THRESHOLD_BYTES come from the heap (the
# largest glibc accepts on 64-bit: half its 64 MiB heap size), and free memory at the heap's top is returned to the
# system only beyond TRIM_THRESHOLD_BYTES. The same two settings as environment variables, for a child process.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 2**31 - 1
KEEP_FREED_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
                         "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES)}
_malloc_state = "default"


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory a step frees for the next step; True where applied.

    A prefill step's activations are megabytes each ((tokens, hidden) and (tokens, intermediate) per layer). By
    default glibc gives blocks over its mmap threshold (128 KiB at first, raised as such blocks are freed) fresh
    pages from the kernel and returns them when freed, so a step pays a page fault for every 4 KiB it writes
    there. With the thresholds above the pages stay mapped and are reused (the process keeps its peak heap).
    ``benchmarks/keep_freed_memory.py`` measures it on the saturated trace (``data/cpu/keep_freed_memory.json``).
    vLLM's CPU platform preloads tcmalloc for the same reason, where its build bundles it; peers compared with us get
    these settings as environment variables (``peer_malloc_env``).

    Applies once per process, with ``mallopt`` (glibc only: elsewhere, e.g. macOS or musl, nothing changes and it
    returns False). ``MINIBATCH_KEEP_FREED_MEMORY=0`` in the environment turns it off, for A/B runs. Called by
    every CPU ``ModelRunner``; ``malloc_state()`` says what holds now (results record it)."""
    global _malloc_state
    if _malloc_state == "kept freed memory":
        return True
    why_not = _why_not_kept()
    if why_not:
        _malloc_state = f"default ({why_not})"
        return False
    import ctypes

    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1 or libc.mallopt(M_TRIM_THRESHOLD,
                                                                                 TRIM_THRESHOLD_BYTES) != 1:
        _malloc_state = "default (mallopt refused the settings)"
        return False
    _malloc_state = "kept freed memory"
    return True


@functools.cache
def _is_glibc() -> bool:
    import platform

    return platform.libc_ver()[0] == "glibc"  # reads the interpreter's binary: once per process


def _why_not_kept() -> str | None:
    """Why freed memory is not kept in this process (the environment turned it off, or the C library is not glibc);
    None where it is to be kept."""
    if os.environ.get("MINIBATCH_KEEP_FREED_MEMORY", "1") == "0":
        return "MINIBATCH_KEEP_FREED_MEMORY=0"
    return None if _is_glibc() else "not glibc"


def peer_malloc_env() -> dict[str, str]:
    """The environment variables that give another engine's processes (vLLM, ``transformers serve``) the allocator
    settings our engine runs with: ``KEEP_FREED_MEMORY_ENV`` on glibc unless ``MINIBATCH_KEEP_FREED_MEMORY=0``,
    else none. Peers compared with us run under the same allocator as we do."""
    return {} if _why_not_kept() else dict(KEEP_FREED_MEMORY_ENV)


def malloc_state() -> str:
    """"kept freed memory" once ``keep_freed_memory`` applied in this process, else "default" (with why, once it was
    asked and did not apply)."""
    return _malloc_state


MADV_HUGEPAGE = 14  # Linux's <sys/mman.h>
HUGE_PAGE_BYTES = 2 << 20
_huge_pages_state = "not asked"


def transparent_huge_pages(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str:
    """This Linux kernel's transparent huge page mode: "always", "madvise" or "never" ("" where unknown)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def huge_page_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape`` and ``dtype`` whose memory the kernel is asked to back with 2 MiB pages
    (``madvise(MADV_HUGEPAGE)`` on the whole 2 MiB pages inside it, before its pages are first written).

    Why: a decode step reads the KV cache a block at a time through block tables, the blocks scattered over the
    whole cache, so with 4 KiB pages most block reads also miss the TLB (2 MiB pages: 512 times fewer entries).
    ``benchmarks/kv_huge_pages.py`` measures it (``data/cpu/kv_huge_pages.json``). Applies on Linux where the
    transparent huge page mode is "madvise" (where it is "always" the kernel does it unasked); elsewhere, or with
    ``MINIBATCH_HUGE_PAGES=0`` in the environment (for A/B runs), it is ``torch.zeros``. ``huge_pages_state()``
    says what the last call did (results record it)."""
    global _huge_pages_state
    mode = transparent_huge_pages()
    why_not = ("MINIBATCH_HUGE_PAGES=0" if os.environ.get("MINIBATCH_HUGE_PAGES", "1") == "0"
               else None if mode == "madvise" else f"transparent huge pages: {mode or 'unknown'}")
    t = torch.empty(shape, dtype=dtype)
    begin = -(-t.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if why_not is None and end > begin:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        why_not = f"madvise failed (errno {ctypes.get_errno()})" if libc.madvise(begin, end - begin,
                                                                                 MADV_HUGEPAGE) else None
    _huge_pages_state = ("advised" if why_not is None and end > begin
                         else f"not advised ({why_not or 'under one 2 MiB page'})")
    return t.zero_()


def huge_pages_state() -> str:
    """What the last ``huge_page_zeros`` did: "advised", "not advised (why)", or "not asked" in this process."""
    return _huge_pages_state


@contextmanager
def native_stderr_hidden():
    """torch's profiler library writes a line to the process's stderr (file descriptor 2, not ``sys.stderr``) at
    every start and stop; hide them while the block runs. Python exceptions still propagate."""
    import sys

    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def raise_fd_limit() -> None:
    """Raise this process's soft limit on open files to its hard one (a server, or a load generator, holds one per
    connection)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, OSError, ValueError):  # not allowed or not supported: keep the limit there is
        pass


def check_listen_address(host: str, port: int) -> None:
    """Raise ValueError (naming --host and --port) unless a server can listen on ``host``:``port`` now: the name
    resolves and the port is free (a test bind, closed at once)."""
    import errno
    import socket

    if not host.strip():
        raise ValueError("--host must be a host name or address (127.0.0.1: this machine only; 0.0.0.0: every "
                         "interface), got ''")
    try:
        bound = 0
        for family, kind, _, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            with socket.socket(family, kind) as s:  # every address the name gives, as the server binds them
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
                try:
                    s.bind(address)
                    bound += 1
                except OSError as e:
                    if e.errno != errno.EADDRNOTAVAIL:  # an address family this machine lacks is skipped
                        raise
        if not bound:
            raise OSError(errno.EADDRNOTAVAIL, "no address of this host is on this machine")
    except (OSError, UnicodeError) as e:  # UnicodeError: a name no DNS label can hold
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({getattr(e, 'strerror', None) or e})") \
            from None
