"""The roofline model of a step: a machine's peak arithmetic rate and memory bandwidth, the lower bound they put
on a step's time, and the ridge point between the two regimes. One home for the numbers that notebook 00's cost
story, the analytical GPU profiles (``experiments.rate_sweep.roofline_profile``) and a step profile use.

Roofline: Williams, Waterman and Patterson, "Roofline: an insightful visual performance model for multicore
architectures", CACM 52(4), 2009. Applied to a transformer step: every weight is read once per step
(``params x bytes_per_param`` bytes) and every token computed costs 2 FLOPs per parameter, so

    step_s >= max(params * bytes_per_param / bytes_per_s,  2 * params * tokens / peak_flop_per_s)

A step below the ridge point is **memory-bound**: its time is the weight read and stays flat as tokens are added.
Past the ridge it is **compute-bound**: its time grows in proportion to the tokens.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass(frozen=True)
class Roofline:
    """A machine's two roofs. peak_flop_per_s: dense matrix-multiply FLOP/s; bytes_per_s: memory bandwidth
    (bytes/s); source: where the numbers come from (a datasheet, or "measured: ..." with how)."""

    name: str
    peak_flop_per_s: float
    bytes_per_s: float
    source: str

    def ridge_tokens(self, bytes_per_param: float = 2) -> float:
        """Tokens per step at which computing them takes as long as reading the weights once
        (peak x bytes_per_param / (2 x bandwidth)); independent of the model's size."""
        return ridge_tokens(self.peak_flop_per_s, self.bytes_per_s, bytes_per_param)

    def step_s(self, params: float, tokens, bytes_per_param: float = 2) -> np.ndarray:
        """The roofline lower bound (s) on a step of ``tokens`` (scalar or array) for a model of ``params``."""
        return roofline_step_s(params, tokens, self.peak_flop_per_s, self.bytes_per_s, bytes_per_param)


def ridge_tokens(peak_flop_per_s: float, bytes_per_s: float, bytes_per_param: float = 2) -> float:
    """Tokens per step at which computing them (2 FLOPs per parameter each) takes as long as reading every
    weight once: below it a step is memory-bound, above it compute-bound."""
    return peak_flop_per_s * bytes_per_param / (2 * bytes_per_s)


def roofline_step_s(params: float, tokens, peak_flop_per_s: float, bytes_per_s: float, bytes_per_param: float = 2):
    """Lower bound on a step's time (s) for each number of tokens: the larger of reading every weight once
    (params x bytes_per_param / bytes_per_s) and computing 2 FLOPs per parameter per token (/ peak_flop_per_s).
    KV cache reads, attention FLOPs and kernel launches only add to it. Returns an array shaped like ``tokens``."""
    tokens = np.asarray(tokens, dtype=float)
    return np.maximum(params * bytes_per_param / bytes_per_s, 2 * params * tokens / peak_flop_per_s)


# NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 Tensor Core 1,979 TFLOP/s with 2:4 sparsity, so 989 dense;
# 3.35 TB/s HBM3
H100_SXM = Roofline("H100 SXM", 989e12, 3.35e12, "NVIDIA H100 Tensor Core GPU datasheet (dense BF16, HBM3)")


@contextmanager
def torch_threads(num_threads: int | None):
    """Run the block with ``num_threads`` torch CPU threads (None: leave them), restoring the old count after: one
    thread keeps wall-clock timings steady on a shared CPU."""
    old = torch.get_num_threads()
    torch.set_num_threads(num_threads or old)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def min_time_s(fn, repeats: int = 5) -> float:
    """Shortest wall time (s) of ``repeats`` calls of ``fn()`` after one warm-up call."""
    return _times_s(fn, repeats)[0]


def median_time_s(fn, repeats: int = 5) -> float:
    """Median wall time (s) of ``repeats`` calls of ``fn()`` after one warm-up call."""
    return statistics.median(_times_s(fn, repeats))


def _times_s(fn, repeats: int) -> list[float]:
    """Sorted wall times (s) of ``repeats`` calls of ``fn()`` after one warm-up call (first calls allocate and
    pick kernels)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)


MIN_STREAM_BYTES, MAX_STREAM_BYTES = 256 * 2**20, 2 * 2**30


def stream_bytes(llc_bytes: int | None = None, available_bytes: int | None = None) -> int:
    """How many bytes the bandwidth roof sums: 4x the last-level caches (``llc_bytes``; default: this machine's,
    ``machine.last_level_cache_bytes``), so that the sum reads memory, not cache: the array-size rule of the STREAM
    benchmark (McCalpin, stream.c's instructions: each array at least 4x the size of the sum of all the last-level
    caches). At least 256 MiB, at most 2 GiB and a quarter of ``available_bytes`` (default: the memory available
    now); whole MiB."""
    import psutil

    from minibatch.machine import last_level_cache_bytes

    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    wanted = min(max(MIN_STREAM_BYTES, 4 * llc), MAX_STREAM_BYTES, max(MIN_STREAM_BYTES, available // 4))
    return wanted >> 20 << 20


def bandwidth_probe(read_bytes: int | None = None):
    """A function that sums a ``read_bytes`` float32 tensor (default :func:`stream_bytes`) once and returns the
    bytes/s it read: the memory bandwidth this moment gives. :func:`measure_cpu`'s roof is the best of several; the
    step profile pairs single ones with its steps (a shared host's bandwidth moves with what other tenants run). The
    tensor lives as long as the function."""
    read_bytes = read_bytes or stream_bytes()
    x = torch.ones(read_bytes // 4, dtype=torch.float32)

    def probe() -> float:
        t0 = time.perf_counter()
        x.sum()
        return read_bytes / (time.perf_counter() - t0)

    return probe


def peak_probe(dtype: torch.dtype = torch.float32, matmul_size: int = 2048, packed_kernel: bool = False):
    """A function that times one ``matmul_size``-square matrix product in ``dtype`` (in float32 with
    ``packed_kernel``, also the same product on our packed kernel, ``kernels.cpu_linear``, where it builds: the
    faster of the two counts) and returns its FLOP/s: the compute this moment gives, as :func:`bandwidth_probe` gives
    the bandwidth. :func:`measure_cpu`'s peak is the best of several calls; the step profile pairs single ones with
    its steps (on a shared host another tenant can take a core's cycles for a while). ``probe.what`` names what it
    times; the matrices live as long as the function."""
    n = matmul_size
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    products, what = [lambda: a @ b], "matmul"
    if packed_kernel and dtype == torch.float32:
        from minibatch.kernels import cpu_linear

        if cpu_linear.available():
            panels = cpu_linear.pack_weight(b.t())
            products.append(lambda: cpu_linear.packed_linear(a, panels, n))
            what = "matmul (the faster of torch's and our packed kernel's)"

    def probe() -> float:
        best = 0.0
        for product in products:
            t0 = time.perf_counter()
            product()
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
        return best

    probe.what = what
    return probe


def measure_cpu(num_threads: int | None = 1, dtype: torch.dtype = torch.float32, matmul_size: int = 2048,
                read_bytes: int | None = None, repeats: int = 5, packed_kernel: bool = False) -> Roofline:
    """This CPU's roofs, measured (about two seconds): peak = the FLOP/s of a ``matmul_size``-square matrix product
    in ``dtype`` (:func:`peak_probe`); bandwidth = the bytes/s of summing a ``read_bytes`` tensor (default
    :func:`stream_bytes`: four times the last-level caches, at least 256 MiB; :func:`bandwidth_probe`); each the
    best of ``repeats`` calls after a warm-up (a roof is the most the machine does; a busy moment only lowers a run).
    num_threads: torch threads while measuring (restored; None leaves them). packed_kernel: in float32, also time
    the same product on our packed kernel (``kernels.cpu_linear``, where it builds) and keep the higher peak: on some
    CPUs it beats torch's own (MKL's) product, and a roof below what a kernel reaches would not bound anything."""
    threads = num_threads or torch.get_num_threads()
    with torch_threads(num_threads):
        compute = peak_probe(dtype, matmul_size, packed_kernel)
        compute()  # warm-up: first calls allocate and pick kernels
        peak, what = max(compute() for _ in range(repeats)), compute.what
        read_bytes = read_bytes or stream_bytes()
        probe = bandwidth_probe(read_bytes)
        probe()  # warm-up: the first pass faults the pages in
        bandwidth = max(probe() for _ in range(repeats))
        del probe, compute
    return Roofline(f"this CPU, {threads} thread{'s' * (threads > 1)}", peak, bandwidth,
                    f"measured: {matmul_size}x{matmul_size} {str(dtype).removeprefix('torch.')} {what}, "
                    f"sum of {read_bytes // 2**20} MiB, best of {repeats}")


def measure_device(device: torch.device, dtype: torch.dtype, packed_kernel: bool = False,
                   repeats: int = 10) -> Roofline:
    """:func:`measure_cuda` on a CUDA device, else :func:`measure_cpu` with torch's thread count (``packed_kernel``:
    as there), each roof the best of ``repeats`` calls."""
    if torch.device(device).type == "cuda":
        return measure_cuda(dtype, repeats=repeats)
    return measure_cpu(torch.get_num_threads(), dtype, repeats=repeats, packed_kernel=packed_kernel)


def higher_roofs(a: Roofline, b: Roofline, when: str, peaks=(), bandwidths=()) -> Roofline:
    """Two measurements of one machine's roofs (``when``: e.g. "before and after the steps") as one, each roof the
    higher of the two: a busy moment on a shared machine only lowers a measured roof. ``peaks``, ``bandwidths``:
    single calls of :func:`peak_probe` and :func:`bandwidth_probe` taken in between (the step profile's paired
    ones), which measure the same roofs: where one saw more, it is the roof (a slow minute can lower both best-of
    measurements of a run, and a roof measured low would put every step closer to it than it is)."""
    peak, bandwidth = max(a.peak_flop_per_s, b.peak_flop_per_s, *peaks), max(a.bytes_per_s, b.bytes_per_s, *bandwidths)
    count = max(len(peaks), len(bandwidths))
    probed = f" and {count} single probes between them" if count else ""
    return replace(a, peak_flop_per_s=peak, bytes_per_s=bandwidth,
                   source=f"{a.source}, the higher of two runs ({when}){probed}")


def measure_cuda(dtype: torch.dtype = torch.bfloat16, matmul_size: int = 8192, copy_bytes: int = 2**30,
                 repeats: int = 5) -> Roofline:
    """The current CUDA device's roofs, measured like :func:`measure_cpu`: peak = a ``matmul_size``-square matrix
    product in ``dtype``, bandwidth = a copy of ``copy_bytes`` (it reads and writes every byte), best of ``repeats``."""
    def synced(fn):
        return lambda: (fn(), torch.cuda.synchronize())

    n = matmul_size
    a, b = torch.randn(n, n, dtype=dtype, device="cuda"), torch.randn(n, n, dtype=dtype, device="cuda")
    peak = 2 * n**3 / min_time_s(synced(lambda: a @ b), repeats)
    x = torch.empty(copy_bytes // 4, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    bandwidth = 2 * copy_bytes / min_time_s(synced(lambda: y.copy_(x)), repeats)
    return Roofline(torch.cuda.get_device_name(), peak, bandwidth,
                    f"measured: {n}x{n} {str(dtype).removeprefix('torch.')} matmul, copy of "
                    f"{copy_bytes // 2**20} MiB, best of {repeats}")
