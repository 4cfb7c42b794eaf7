"""Readability limits every module keeps: the linter's (ruff, configured in pyproject.toml: lines of at
most 120 characters, pyflakes) and a file length a newcomer can read in one sitting."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 300
CODE = ("minibatch", "minibatch_course", "benchmarks", "scripts", "examples")  # the folders of code (tests: ruff only)
LONG_ALLOWED = ("kernels", "kv")  # Triton kernels and the block manager keep their references and proofs beside them


def test_ruff_passes():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    result = subprocess.run([ruff, "check", *CODE, "tests"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_module_over_300_lines():
    """The package, benchmarks, scripts and examples (tests hold tables of cases and are exempt)."""
    files = [p for folder in CODE for p in (ROOT / folder).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in sorted(files)
            if not set(p.relative_to(ROOT).parts[1:-1]) & set(LONG_ALLOWED)
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by idea): {long}"

