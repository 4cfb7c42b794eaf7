"""The roofline (minibatch/roofline.py) and notebook 00's step-cost measurement (minibatch/lessons/step_cost.py):
hand-computed bounds and ridge points, the measured knee of a known curve, and the measurement's shape."""

import numpy as np
import pytest
import torch

from minibatch import ModelRunner
from minibatch.lessons.step_cost import knee_tokens, measure_step_cost, time_linear_layers
from minibatch.models import load_model
from minibatch.machine import last_level_cache_bytes
from minibatch.kernels import cpu_linear
from minibatch.roofline import (H100_SXM, Roofline, bandwidth_probe, higher_roofs, measure_cpu, peak_probe,
                                ridge_tokens, roofline_step_s, stream_bytes)


def test_the_bound_is_the_weight_read_then_the_arithmetic():
    # 1e9 parameters in bf16 = 2e9 bytes at 1e12 B/s: 2 ms; 2e9 FLOPs per token at 1e15 FLOP/s: 2 us per token
    bound = roofline_step_s(1e9, [1, 500, 1000, 2000], 1e15, 1e12, bytes_per_param=2)
    np.testing.assert_allclose(bound, [2e-3, 2e-3, 2e-3, 4e-3])
    assert ridge_tokens(1e15, 1e12, bytes_per_param=2) == 1000  # where 2e9 x N / 1e15 = 2e-3
    assert ridge_tokens(1e15, 1e12, bytes_per_param=4) == 2000  # fp32 weights take twice as long to read


def test_the_h100_ridge_is_its_flops_per_byte_in_bf16():
    assert H100_SXM.ridge_tokens(2) == pytest.approx(989e12 / 3.35e12)  # ~295 tokens
    assert H100_SXM.step_s(7e9, 1) == pytest.approx(14e9 / 3.35e12)


def test_the_cpu_roofs_are_measured_and_positive():
    cpu = measure_cpu(num_threads=1, matmul_size=128, read_bytes=8 * 2**20, repeats=2)
    assert isinstance(cpu, Roofline) and cpu.peak_flop_per_s > 1e8 and cpu.bytes_per_s > 1e8
    assert cpu.source.startswith("measured") and cpu.ridge_tokens(4) > 0


def test_a_peak_probe_times_one_product_each_call():
    for packed in (False, True):  # float32 with our packed kernel: the faster of the two products counts
        probe = peak_probe(torch.float32, matmul_size=128, packed_kernel=packed)
        rates = [probe() for _ in range(3)]  # FLOP/s of one 128-square product each: a moment's peak
        assert all(r > 1e7 for r in rates) and len(set(rates)) > 1 and "matmul" in probe.what
    assert "packed kernel" in probe.what or not cpu_linear.available()
    assert peak_probe(torch.bfloat16, matmul_size=64)() > 0 and peak_probe(torch.bfloat16).what == "matmul"


def test_the_roofs_are_the_most_any_measurement_saw():
    """Two best-of runs and the single probes between them measure the same roofs: each roof is the highest (a
    slow minute can lower both best-of runs, and a roof measured low would flatter every step)."""
    before, after = Roofline("cpu", 300e9, 40e9, "measured"), Roofline("cpu", 250e9, 45e9, "measured")
    roof = higher_roofs(before, after, "before and after")
    assert (roof.peak_flop_per_s, roof.bytes_per_s) == (300e9, 45e9) and "higher of two runs (before and after)" in (
        roof.source)
    probed = higher_roofs(after, after, "before and after", [410e9, 390e9], [30e9, 44e9])
    assert (probed.peak_flop_per_s, probed.bytes_per_s) == (410e9, 45e9) and "2 single probes" in probed.source


def test_a_bandwidth_probe_measures_one_sum_each_call():
    probe = bandwidth_probe(8 * 2**20)
    rates = [probe() for _ in range(3)]  # bytes/s of one 8 MiB sum each: a moment's bandwidth, not a best-of
    assert all(r > 1e8 for r in rates) and len(set(rates)) > 1


def test_the_bandwidth_roof_reads_four_times_the_last_level_caches():
    """STREAM's rule: the summed tensor is 4x the last-level caches (a cloud slice may see its host's 300 MiB L3,
    which a 256 MiB sum would partly read from cache), at least 256 MiB, at most 2 GiB and a quarter of the free
    memory, whole MiB."""
    mib, gib = 2**20, 2**30
    assert stream_bytes(32 * mib, 16 * gib) == 256 * mib  # a laptop's 32 MiB L3: the floor
    assert stream_bytes(300 * mib, 16 * gib) == 1200 * mib
    assert stream_bytes(1 * gib, 64 * gib) == 2 * gib  # the cap
    assert stream_bytes(300 * mib, 2 * gib) == 512 * mib  # a quarter of what is free
    assert stream_bytes(300 * mib, 100 * mib) == 256 * mib  # never under the floor
    assert stream_bytes(0, 16 * gib) == 256 * mib  # caches unknown
    assert stream_bytes(int(1.5 * mib) + 7, 16 * gib) == 256 * mib


def test_the_last_level_caches_are_read_from_sysfs(tmp_path):
    """Each distinct cache of the highest level once (told apart by the CPUs sharing it), instruction caches
    skipped, unreadable entries ignored; 0 without any."""
    def cache(cpu, index, level, kind, size, shared):
        d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
        d.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
            (d / name).write_text(f"{value}\n")

    assert last_level_cache_bytes(str(tmp_path)) == 0
    for cpu in range(4):  # two L3s of 16 MiB, each shared by two CPUs; private L2s and L1s
        cache(cpu, 0, 1, "Data", "48K", cpu)
        cache(cpu, 1, 1, "Instruction", "32K", cpu)
        cache(cpu, 2, 2, "Unified", "2048K", cpu)
        cache(cpu, 3, 3, "Unified", "16M", "0-1" if cpu < 2 else "2-3")
    (tmp_path / "cpu3" / "cache" / "index4").mkdir()  # no files: skipped
    assert last_level_cache_bytes(str(tmp_path)) == 32 * 2**20


def test_the_knee_of_a_flat_then_linear_curve():
    # flat 100 ms up to 20 tokens, then 5 ms per token: the knee is 100 / 5 = 20 tokens
    points = [(n, max(0.1, 0.005 * n)) for n in (1, 2, 4, 8, 16, 32, 64, 128)]
    knee, per_token = knee_tokens(points)
    assert knee == pytest.approx(20) and per_token == pytest.approx(0.005)


def test_step_cost_times_prefill_tokens_and_decode_rows_at_equal_counts():
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-random-llama", dtype="float32")
    old = torch.get_num_threads()
    out = measure_step_cost(ModelRunner(model, tokenizer), token_counts=(1, 2, 4), context=8, repeats=3)
    assert [n for n, _ in out["prefill"]] == [n for n, _ in out["decode"]] == [1, 2, 4]
    assert all(s > 0 for kind in ("prefill", "decode") for _, s in out[kind])
    assert all(x >= 0 for kind in ("prefill", "decode") for _, x in out["spread"][kind])
    assert torch.get_num_threads() == old  # the thread count is restored
    linears = time_linear_layers(model, rows=(1, 3), repeats=2)
    assert [n for n, _ in linears] == [1, 3] and all(s > 0 for _, s in linears)
