"""The benchmark scripts (``benchmarks/*.py``, a folder of scripts, not a package) loaded by path, for the tests that
call a script's ``main(argv)`` in-process."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a fresh module (its top level run once more on each call)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
