"""Building the C++ kernels: one build per extension whichever thread asks first, and compare's background builds
(``kernels.prebuild.start_kernel_builds``) name the kernels the runner will load. No compiler is run here: the
build itself is replaced by a stand-in. Also what results record about the machine: its instruction sets and its
C allocator's settings (``machine.keep_freed_memory``)."""

import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import torch

from minibatch.kernels import (cpp_build, cpu_amx_linear, cpu_bf16_linear, cpu_decode, cpu_decode_layer, cpu_linear,
                               cpu_prefill)
from minibatch.kernels.cpp_build import CppExtension, build_in_background
from minibatch.kernels.prebuild import start_kernel_builds


def test_a_load_during_a_background_build_waits_for_it_and_builds_once(monkeypatch):
    calls = []

    def slow_build(source, extra_cflags=(), extra_sources=()):
        calls.append(source)
        time.sleep(0.2)
        return f"module of {source}"

    monkeypatch.setattr(cpp_build, "build", slow_build)
    ext = CppExtension("k.cpp", "a kernel")
    thread = build_in_background([ext])
    time.sleep(0.05)  # the build is running
    assert ext.load() == "module of k.cpp"  # waited for the background build, did not start another
    thread.join()
    assert calls == ["k.cpp"] and ext.available()


def test_a_failed_background_build_is_kept_with_its_reason(monkeypatch):
    def failing_build(source, extra_cflags=(), extra_sources=()):
        raise OSError("no compiler\nmore lines")

    monkeypatch.setattr(cpp_build, "build", failing_build)
    ext = CppExtension("k.cpp", "a kernel")
    build_in_background([ext]).join()
    assert not ext.available() and ext.error == "OSError: no compiler"


def fake_torch_load(calls):
    """A stand-in for ``torch.utils.cpp_extension.load`` with torch's own locking: it takes the ``lock`` file in
    the build folder, or, if the file is there, would wait for it to go (here: fails)."""
    from torch.utils.file_baton import FileBaton

    def load(name, sources, *, build_directory, **kwargs):
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if not baton.try_acquire():
            raise AssertionError("would wait for torch's lock file forever")
        calls.append((name, build_directory))
        baton.release()
        return f"module {name}"
    return load


def test_a_lock_file_left_by_a_killed_build_does_not_block_the_next(monkeypatch, tmp_path):
    """A build killed mid-way (Ctrl-C during a first run) leaves torch's ``lock`` file; torch would wait for it
    forever. ``build`` clears it under its own OS lock; folders go under ``$TORCH_EXTENSIONS_DIR``."""
    import torch.utils.cpp_extension

    calls = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_torch_load(calls))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpp_build.build_name(cpu_decode.KERNEL.source)
    folder = cpp_build.build_directory(name)
    assert folder.startswith(str(tmp_path)) and folder.endswith(name)
    open(os.path.join(folder, "lock"), "w").close()  # what a killed build leaves
    assert cpp_build.build(cpu_decode.KERNEL.source) == f"module {name}"
    assert calls == [(name, folder)] and not os.path.exists(os.path.join(folder, "lock"))


def test_another_checkout_of_the_same_sources_loads_the_module_built_before(monkeypatch, tmp_path):
    """``build`` hands torch's builder copies of the sources (headers beside them) in the build folder, each
    rewritten only when its bytes differ: a second checkout (another folder, files written later) passes the same
    paths with the same times, so ninja finds the module built; changed bytes are a new extension."""
    import torch.utils.cpp_extension

    seen = []

    def load(name, sources, *, build_directory, **kwargs):
        folder = Path(sources[0]).parent
        seen.append((name, {f.name: (f.stat().st_mtime_ns, f.read_text()) for f in sorted(folder.iterdir())},
                     [Path(s).name for s in sources]))
        assert folder == Path(build_directory) / "src"
        return name

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    for checkout, value in (("a", 1), ("b", 1), ("c", 2)):
        folder = tmp_path / checkout
        folder.mkdir()
        (folder / "k.cpp").write_text('#include "k.h"\nint f() { return K; }\n')
        (folder / "k.h").write_text(f"#define K {value}\n")
        (folder / "extra.cpp").write_text("int g() { return 2; }\n")
        cpp_build.build(str(folder / "k.cpp"), (), (str(folder / "extra.cpp"),))
        time.sleep(0.01)  # the next checkout's files are newer
    (a, b, c) = seen
    assert a == b and a[2] == ["k.cpp", "extra.cpp"] and set(a[1]) == {"k.cpp", "k.h", "extra.cpp"}
    assert c[0] != a[0] and c[1]["k.h"][1] == "#define K 2\n"
    (tmp_path / "d").mkdir()
    for f in ("k.cpp", "k.h"):
        (tmp_path / "d" / f).write_text("")
    with pytest.raises(ValueError, match="distinct file names"):
        cpp_build.build(str(tmp_path / "d" / "k.cpp"), (), (str(tmp_path / "a" / "k.h"),))


HOLD = """
import sys, time
from minibatch.kernels.cpp_build import exclusive
with exclusive(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="fcntl")
def test_a_build_waits_while_another_process_builds_and_not_after_it_dies(monkeypatch, tmp_path):
    """Another live process building the same extension holds the folder's OS lock: ``build`` waits for it; a
    killed one releases it with its death, so the next build goes on."""
    import torch.utils.cpp_extension

    calls = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_torch_load(calls))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpp_build.build_directory(cpp_build.build_name(cpu_decode.KERNEL.source))
    for kill in (False, True):
        holder = subprocess.Popen([sys.executable, "-c", HOLD, folder, "0.5" if not kill else "60"],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        start = time.perf_counter()
        if kill:
            open(os.path.join(folder, "lock"), "w").close()  # as if it were killed during torch's build
            holder.kill()
        cpp_build.build(cpu_decode.KERNEL.source)
        waited = time.perf_counter() - start
        holder.wait()
        assert waited >= 0.4 if not kill else waited < 30
    assert len(calls) == 2


def test_start_kernel_builds_names_what_the_runner_loads(monkeypatch):
    started = []

    def capture(extensions):
        started.append(list(extensions))
        thread = threading.Thread(target=lambda: None)
        thread.start()
        return thread

    monkeypatch.setattr(cpp_build, "build_in_background", capture)
    monkeypatch.setattr(cpp_build, "compiler_available", lambda: True)
    # bf16 on a CPU with AMX, or else with AVX512-BF16: that linear kernel first (the runner prepacks at load)
    for amx, vnni in ((False, False), (True, True), (False, True)):
        monkeypatch.setattr(cpu_amx_linear, "cpu_has_amx", lambda amx=amx: amx)
        monkeypatch.setattr(cpu_bf16_linear, "cpu_has_avx512_bf16", lambda vnni=vnni: vnni)
        for device, dtype, backend in [("cpu", "float32", "torch"), ("cpu", torch.float32, "cpp"),
                                       ("cpu", "bfloat16", "cpp"), ("cpu", "bfloat16", "sdpa"),
                                       ("cuda", "float32", "cpp")]:
            start_kernel_builds(device, dtype, backend).join()
    layer = [cpu_decode.KERNEL, cpu_decode_layer.KERNEL]
    # the cpp backend's prefill kernel last: float32 on any CPU (AVX2 or AVX-512), bf16 with AVX512-BF16 (AMX CPUs
    # have it too)
    float32_cpp = [cpu_linear.KERNEL, *layer, cpu_prefill.KERNEL]
    assert started[:5] == [[cpu_linear.KERNEL], float32_cpp, layer, [], []]
    assert started[5:10] == [[cpu_linear.KERNEL], float32_cpp,
                             [cpu_amx_linear.KERNEL, *layer, cpu_prefill.KERNEL], [cpu_amx_linear.KERNEL], []]
    assert started[10:] == [[cpu_linear.KERNEL], float32_cpp,
                            [cpu_bf16_linear.KERNEL, *layer, cpu_prefill.KERNEL], [cpu_bf16_linear.KERNEL], []]
    monkeypatch.setattr(cpp_build, "compiler_available", lambda: False)  # nothing to build with: nothing started
    start_kernel_builds("cpu", "float32", "cpp").join()
    assert started[-1] == []


def test_another_instruction_set_builds_its_own_kernel(monkeypatch):
    """``-march=native`` code from a CPU with AVX-512 must not load on one without, even when both report the same
    model string: the build's name covers the vector instruction sets."""
    from minibatch import machine

    monkeypatch.setattr(machine, "cpu_model", lambda: "AMD EPYC")
    names = set()
    for isa in ("avx avx2 fma f16c", "avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16"):
        monkeypatch.setattr(machine, "cpu_isa", lambda isa=isa: isa)
        names.add(cpp_build.build_name(cpu_linear.KERNEL.source))
        assert cpp_build.build_name(cpu_linear.KERNEL.source) in names  # the same machine: the same name
    assert len(names) == 2


def test_machine_differences_name_the_instruction_sets():
    from minibatch.report import cpu_isa, environment, machine_differences

    here = environment()
    assert here["cpu_isa"] == cpu_isa() and machine_differences(here, environment()) == []
    assert machine_differences(here | {"cpu_isa": "avx2 fma"}, here | {"cpu_isa": "avx2 fma avx512f"}) == [
        "cpu_isa: avx2 fma -> avx2 fma avx512f"]
    older = {k: v for k, v in here.items() if k != "cpu_isa"}  # recorded before cpu_isa was: no line for it
    assert machine_differences(older, here) == []


def test_one_model_string_two_generations(tmp_path, monkeypatch):
    """A Zen 4 and a Zen 5 "AMD EPYC" with the same instruction sets: the family and model numbers tell them apart,
    in a profile's machine check and in the kernels' build name; a profile recorded before cpu_id gets no line."""
    from minibatch import machine
    from minibatch.report import environment, machine_differences

    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                   "model name\t: AMD EPYC\nstepping\t: 1\n\nprocessor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n")
    assert machine.cpu_id(str(x86)) == "family 26 model 2"  # the first processor's
    assert machine.cpu_id(str(arm)) == "implementer 0x41 part 0xd0c"
    assert machine.cpu_id(str(tmp_path / "none")) == ""
    here = environment()
    assert here["cpu_id"] == machine.cpu_id()
    zen4, zen5 = here | {"cpu_id": "family 25 model 17"}, here | {"cpu_id": "family 26 model 2"}
    assert machine_differences(zen4, zen5) == ["cpu_id: family 25 model 17 -> family 26 model 2"]
    assert machine_differences({k: v for k, v in zen4.items() if k != "cpu_id"}, zen5) == []
    names = set()
    for generation in ("family 25 model 17", "family 26 model 2"):
        monkeypatch.setattr(machine, "cpu_id", lambda g=generation: g)
        names.add(cpp_build.build_name(cpu_linear.KERNEL.source))
    assert len(names) == 2


KEEP = """
import ctypes, json, sys
from minibatch.machine import keep_freed_memory, malloc_state
before = malloc_state()
applied = keep_freed_memory()
again = keep_freed_memory()
buf = [bytearray(8 << 20) for _ in range(4)]  # 8 MiB blocks: from the heap now, under the 32 MiB threshold
del buf
json.dump([before, applied, again, malloc_state()], sys.stdout)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_applies_once_per_process_unless_turned_off():
    """In a fresh interpreter each time: the setting is process-wide. Where it applies, results record it
    (``report.environment()["malloc"]``); MINIBATCH_KEEP_FREED_MEMORY=0 leaves glibc's defaults."""
    import json

    def run(**env):
        out = subprocess.run([sys.executable, "-c", KEEP], capture_output=True, text=True, check=True,
                             env=os.environ | env)
        return json.loads(out.stdout)

    assert run() == ["default", True, True, "kept freed memory"]
    assert run(MINIBATCH_KEEP_FREED_MEMORY="0") == ["default", False, False,
                                                    "default (MINIBATCH_KEEP_FREED_MEMORY=0)"]


def test_a_cpu_runner_keeps_freed_memory_and_results_say_so(monkeypatch):
    from minibatch import machine
    from minibatch.models import load_model
    from minibatch.report import environment
    from minibatch.runner import ModelRunner

    calls = []
    monkeypatch.setattr("minibatch.runner.model_runner.keep_freed_memory", lambda: calls.append(1))
    monkeypatch.setattr(machine, "_malloc_state", "kept freed memory")
    ModelRunner(*load_model("tiny-random-llama", dtype="float32"))
    assert calls == [1] and environment()["malloc"] == "kept freed memory"
