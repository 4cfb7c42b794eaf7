"""The KV cache on 2 MiB pages (minibatch/machine.py, ``huge_page_zeros``): the tensor it returns is zeros of the
asked shape and dtype, and where Linux's transparent huge pages are in "madvise" mode the kernel really marks the
whole 2 MiB pages inside it for huge pages (``hg`` in /proc/self/smaps); MINIBATCH_HUGE_PAGES=0 and other modes leave
it plain; a CPU ModelRunner's KV cache is allocated this way and results record what happened."""

import pytest
import torch

from minibatch import machine


def vm_flags_at(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (Linux's /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return []


def test_reads_the_mode_the_kernel_marks():
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write("always [madvise] never\n")
        f.flush()
        assert machine.transparent_huge_pages(f.name) == "madvise"
    assert machine.transparent_huge_pages("/nonexistent/enabled") == ""


@pytest.mark.parametrize("shape,dtype", [((4, 2, 300, 16, 3, 64), torch.bfloat16), ((3, 5), torch.float32)])
def test_gives_zeros_of_the_shape_and_dtype(shape, dtype, monkeypatch):
    for setting in ("1", "0"):
        monkeypatch.setenv("MINIBATCH_HUGE_PAGES", setting)
        t = machine.huge_page_zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
        assert not t.any()


@pytest.mark.skipif(machine.transparent_huge_pages() != "madvise",
                    reason="transparent huge pages are not in madvise mode here")
def test_marks_the_whole_huge_pages_inside_it_unless_turned_off(monkeypatch):
    t = machine.huge_page_zeros((8 << 20,), torch.float32)  # 32 MiB: whole 2 MiB pages inside, wherever it starts
    assert machine.huge_pages_state() == "advised"
    inside = -(-t.data_ptr() // machine.HUGE_PAGE_BYTES) * machine.HUGE_PAGE_BYTES + machine.HUGE_PAGE_BYTES
    assert "hg" in vm_flags_at(inside)
    monkeypatch.setenv("MINIBATCH_HUGE_PAGES", "0")
    plain = machine.huge_page_zeros((8 << 20,), torch.float32)
    assert machine.huge_pages_state() == "not advised (MINIBATCH_HUGE_PAGES=0)"
    assert "hg" not in vm_flags_at(plain.data_ptr() + 3 * machine.HUGE_PAGE_BYTES)
    small = machine.huge_page_zeros((16,), torch.float32)  # no whole 2 MiB page inside
    assert not small.any() and machine.huge_pages_state().startswith("not advised")


def test_other_modes_leave_it_plain(monkeypatch):
    for mode in ("never", "always", ""):
        monkeypatch.setattr(machine, "transparent_huge_pages", lambda mode=mode: mode)
        t = machine.huge_page_zeros((1 << 20,), torch.float32)
        why = f"transparent huge pages: {mode or 'unknown'}"
        assert not t.any() and machine.huge_pages_state() == f"not advised ({why})"


def test_a_cpu_runner_allocates_its_kv_cache_so_and_results_say_so(monkeypatch):
    from minibatch.models import load_model
    from minibatch.report import environment
    from minibatch.runner import ModelRunner, model_runner

    shapes = []

    def recorded(shape, dtype):
        shapes.append((tuple(shape), dtype))
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(model_runner, "huge_page_zeros", recorded)
    monkeypatch.setattr(machine, "_huge_pages_state", "advised")
    runner = ModelRunner(*load_model("tiny-random-llama", dtype="float32"))
    runner.allocate_kv_cache(num_blocks=8, block_size=4)
    assert shapes == [(tuple(runner.kv_cache.shape), torch.float32)]
    assert environment()["kv_huge_pages"] == "advised"
