"""The course's stable edition: dependency ranges with tested upper bounds, a constraints file inside
them, one version number."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

import minibatch

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_constraints_pin_every_dependency_inside_its_range():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    pins = {norm(k): v for k, v in pins.items()}
    for spec in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"]:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate():
            continue
        assert norm(req.name) in pins, f"constraints.txt does not pin {req.name}"
        assert req.specifier.contains(pins[norm(req.name)], prereleases=True), \
            f"constraints.txt pins {req.name}=={pins[norm(req.name)]}, outside {req.specifier}"


def test_the_results_changing_dependencies_have_upper_bounds():
    bounded = {norm(Requirement(s).name): Requirement(s).specifier for s in PROJECT["dependencies"]}
    for name in ("torch", "transformers", "triton", "numpy", "matplotlib"):
        assert any(s.operator in ("<", "<=", "==", "~=") for s in bounded[name]), f"{name} has no upper bound"


def test_one_version_number():
    assert PROJECT["version"] == minibatch.__version__


def test_the_kernels_sources_and_headers_are_package_data():
    """A non-editable install builds the C++ kernels from the installed package: every source and header they
    include must be shipped."""
    import fnmatch

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["minibatch"]
    kernels = [p.relative_to(ROOT / "minibatch").as_posix() for p in (ROOT / "minibatch" / "kernels").iterdir()
               if p.suffix in (".cpp", ".h")]
    assert kernels and all(any(fnmatch.fnmatch(k, pat) for pat in patterns) for k in kernels), kernels


def test_the_package_and_its_command_line_load_without_transformers():
    """transformers (with torch's compiler, which it pulls in) took ~2.5 of the ~5 s that `python -m minibatch
    simulate --help` spent importing; only loading a model needs it, so the loaders import it when they run."""
    import subprocess
    import sys

    code = ("import sys, minibatch, minibatch.__main__, minibatch.sim.simulator, minibatch.cluster.simulate; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
