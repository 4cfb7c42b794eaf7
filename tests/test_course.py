"""The course's scaffolding: every notebook opens with its learning goals, prerequisites and a time estimate,
and ends with what it measured and a link to the next notebook (the last one to where to go next)."""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIME = re.compile(r"\*\*Time\.\*\*[^\n]*?about (\d+) minutes", re.I)
NEXT = re.compile(r"\*\*Next:\*\* \[[^\]]+\]\(([\w.]+\.ipynb)\)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_opens_with_goals_prerequisites_and_time(path):
    head = nbformat.read(path, as_version=4).cells[0].source
    prefix = path.name.split("_")[0]  # "00", or "00b" for a chapter added after 00
    assert head.startswith(f"# {prefix} · "), f"{path.name}: cell 0 starts with '# {prefix} · Title'"
    goals = head.split("**Goals.**")[1].split("**Before you start.**")[0] if "**Goals.**" in head else ""
    assert len(re.findall(r"(?m)^\d+\. ", goals)) >= 2, f"{path.name}: a numbered list of learning goals"
    assert "**Before you start.**" in head, f"{path.name}: prerequisites"
    assert TIME.search(head), f"{path.name}: '**Time.** about N minutes'"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_ends_with_what_it_measured_and_the_next_notebook(path):
    last = nbformat.read(path, as_version=4).cells[-1].source
    assert last.startswith("## What we measured"), f"{path.name}: last cell '## What we measured'"
    assert re.search(r"\d", last), f"{path.name}: what we measured, with numbers"
    later = NOTEBOOKS[NOTEBOOKS.index(path) + 1:]
    if later:
        assert NEXT.search(last) and NEXT.search(last).group(1) == later[0].name, \
            f"{path.name}: ends with '**Next:** [..]({later[0].name})'"


def test_the_course_time_adds_up():
    minutes = [int(TIME.search(nbformat.read(p, as_version=4).cells[0].source).group(1)) for p in NOTEBOOKS]
    assert all(5 <= m <= 120 for m in minutes), minutes


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_prints_the_current_version(path):
    """The version cell's committed output names the package version the notebook ran with: a stale one means
    its outputs were not re-run after a release."""
    from minibatch import __version__

    printed = [o.get("text", "") for c in nbformat.read(path, as_version=4).cells[:6] if c.cell_type == "code"
               for o in c.get("outputs", [])]
    versions = re.findall(r"minibatch (\d+\.\d+\.\d+)", "".join(printed))
    assert versions == [__version__], f"{path.name}: prints minibatch {versions}, the package is {__version__}"
