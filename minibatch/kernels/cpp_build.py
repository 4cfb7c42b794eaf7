"""Building this package's C++ CPU kernels (``*.cpp`` beside this file) on first use, once per machine.

``torch.utils.cpp_extension.load`` compiles a source (a C++ compiler with OpenMP; ninja) into torch's extension
cache the first time it is used on a machine (tens of seconds), then loads it from there, from any checkout of the
same sources (:func:`source_copies`). :class:`CppExtension` keeps the module, or the first line of why it could not
be built, for the message.

A build interrupted by a kill (Ctrl-C during a first ``compare``) leaves torch's lock file (``lock``) in its build
folder, and every later ``load`` of that extension would wait for it forever, silently. So :func:`build` holds an
OS lock of its own on the folder (``fcntl.flock``: released by the kernel when its process dies, however it dies)
and, holding it, removes torch's ``lock`` file if it is there: no live minibatch process can be building then.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
from contextlib import contextmanager

import torch

# -fopenmp also for the compile: ATen's parallel_for is a header template whose OpenMP pragmas are ignored without
# it (the loop then runs on one thread)
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def compiler_available() -> bool:
    """Whether the C++ compiler torch's extension builder calls (``$CXX``, else ``c++``) is on this machine: where it
    is, a kernel that does not build is a bug (tests fail on it rather than skip)."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def build_inputs(source: str, extra_sources: tuple[str, ...] = ()) -> list[str]:
    """Every file a build of ``source`` reads: it, ``extra_sources``, then the headers (``*.h``) beside it."""
    folder = os.path.dirname(os.path.abspath(source))
    headers = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".h"))
    return [source, *extra_sources, *headers]


def build_name(source: str, extra_cflags: tuple[str, ...] = (), extra_sources: tuple[str, ...] = ()) -> str:
    """The extension's name: ``minibatch_`` + the source's file name + a hash of the sources, the headers beside
    them, flags, torch version, CPU model, family and model numbers and vector instruction sets (``-march=native``
    code is only valid on the CPU it was built for, so another CPU sharing the cache builds its own, also one with
    the same model string)."""
    from minibatch.machine import cpu_id, cpu_isa, cpu_model

    key = b""
    for path in build_inputs(source, extra_sources):
        with open(path, "rb") as f:
            key += f.read()
    machine = [torch.__version__, platform.machine(), cpu_model(), cpu_id(), cpu_isa()]
    key += " ".join(CFLAGS + list(extra_cflags) + machine).encode()
    stem = os.path.splitext(os.path.basename(source))[0]
    return f"minibatch_{stem}_" + hashlib.sha256(key).hexdigest()[:12]


def build_directory(name: str) -> str:
    """The folder extension ``name`` is built in (made if missing): ``$TORCH_EXTENSIONS_DIR``, else torch's
    default extension root, then ``minibatch_py<major><minor>/<name>`` (the name hashes the torch version, not
    Python's, and a module is built for one Python)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    folder = os.path.join(root, f"minibatch_py{sys.version_info.major}{sys.version_info.minor}", name)
    os.makedirs(folder, exist_ok=True)
    return folder


@contextmanager
def exclusive(folder: str):
    """Hold an exclusive OS lock on ``folder`` (a file ``minibatch.lock`` in it, ``fcntl.flock``); waits while
    another process or thread holds it. The lock dies with its process. Where ``fcntl`` is missing (Windows) it
    holds nothing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(os.path.join(folder, "minibatch.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(source: str, extra_cflags: tuple[str, ...] = (), extra_sources: tuple[str, ...] = ()):
    """Compile ``source`` (with ``extra_sources`` linked into the same module, and ``extra_cflags`` after
    :data:`CFLAGS`, e.g. a ``-D`` a test builds a variant with) into :func:`build_directory`, or load it from there;
    returns the module. It compiles :func:`source_copies` of the files, so that another checkout of the same bytes
    loads the module built before. Holds :func:`exclusive` on the folder meanwhile, and clears a lock file torch left
    there when a build was killed. Raises whatever the build raises (ValueError: two inputs of one file name)."""
    from torch.utils.cpp_extension import load as load_extension

    name = build_name(source, extra_cflags, extra_sources)
    folder = build_directory(name)
    with exclusive(folder):
        stale = os.path.join(folder, "lock")  # torch's lock; only a killed build can have left it while we hold ours
        if os.path.exists(stale):
            os.remove(stale)
        copies = source_copies(folder, build_inputs(source, extra_sources))
        return load_extension(name, copies[:1 + len(extra_sources)], extra_cflags=CFLAGS + list(extra_cflags),
                              extra_ldflags=["-fopenmp"], build_directory=folder, verbose=False)


def source_copies(folder: str, paths: list[str]) -> list[str]:
    """Copies of ``paths`` (by file name) in ``folder``/src, the build compiles those: each written only where its
    bytes differ, so they keep their paths and times from one checkout to the next. torch's builder runs ninja, which
    rebuilds what is older than its sources or was built from other paths: from the files themselves, a fresh clone
    (all files newer than the objects) or one in another folder would compile again a kernel that :func:`build_name`,
    a hash of the same bytes, says is built. Returns the copies' paths, in ``paths``' order."""
    names = [os.path.basename(p) for p in paths]
    if len(set(names)) != len(names):
        raise ValueError(f"build inputs must have distinct file names: {names}")
    src = os.path.join(folder, "src")
    os.makedirs(src, exist_ok=True)
    copies = []
    for path, name in zip(paths, names):
        with open(path, "rb") as f:
            data = f.read()
        copy = os.path.join(src, name)
        try:
            with open(copy, "rb") as f:
                same = f.read() == data
        except OSError:
            same = False
        if not same:
            with open(copy + ".tmp", "wb") as f:
                f.write(data)
            os.replace(copy + ".tmp", copy)  # a build killed mid-write leaves no half file under the name
        copies.append(copy)
    return copies


class CppExtension:
    """One C++ source (``source``, with ``extra_sources`` linked in and ``extra_cflags``), built by :func:`build`
    the first time :meth:`load` is called; ``what`` names it in the error. ``module``: the built module, or None;
    ``error``: why it could not be built, or None."""

    def __init__(self, source: str, what: str, extra_sources: tuple[str, ...] = (),
                 extra_cflags: tuple[str, ...] = ()):
        self.source, self.what = source, what
        self.extra_sources, self.extra_cflags = tuple(extra_sources), tuple(extra_cflags)
        self.module = None
        self.error: str | None = None
        self._lock = threading.Lock()  # one build at a time: a caller arriving during a build waits for its module

    def load(self):
        """The compiled module (built the first time on this machine; a call from another thread during that build
        waits for it).

        Raises:
            RuntimeError: it could not be built (no compiler, no OpenMP, ...); the message gives the first line of
                why."""
        with self._lock:
            if self.module is None and self.error is None:
                try:
                    self.module = build(self.source, self.extra_cflags, self.extra_sources)
                except Exception as e:  # noqa: BLE001 - any build failure makes the kernel unavailable, with its reason
                    self.error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        if self.module is None:
            raise RuntimeError(f"{self.what} could not be built: {self.error}")
        return self.module

    def available(self) -> bool:
        """Whether it is built (or can be built now) on this machine."""
        try:
            self.load()
            return True
        except RuntimeError:
            return False


def build_in_background(extensions: list[CppExtension]) -> threading.Thread:
    """Start building ``extensions`` (one after another) on a daemon thread and return it. The compiler runs as a
    subprocess, so the caller goes on meanwhile (on a fresh machine ``compare`` converts and loads the model during
    the builds, which take tens of seconds each); whoever loads an extension later (there: the ModelRunner, built
    before the reference outputs) waits for its build if it is still running. A build that fails is recorded on its
    extension, as :meth:`load` does."""
    def run():
        for ext in extensions:
            ext.available()

    thread = threading.Thread(target=run, name="minibatch-kernel-builds", daemon=True)
    thread.start()
    return thread
