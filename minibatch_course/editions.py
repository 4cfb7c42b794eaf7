"""Student and instructor editions of the notebooks, built from one source.

The notebooks in ``notebooks/`` are the source. Their exercise cells mark solutions with
otter-grader's conventions (no otter install needed: it is a large autograder, and a course only
needs the stubs):

    my_answer = 26  # SOLUTION           -> student: my_answer = ...
    # BEGIN SOLUTION                     -> student: the lines in between become one "..."
    ...                                              (at the first line's indentation)
    # END SOLUTION
    <!-- BEGIN SOLUTION --> ... <!-- END SOLUTION -->   (markdown: removed from the student's text)

``build(source, out)`` writes ``out/student/*.ipynb`` (solutions replaced by stubs, every output
cleared: an output could show an answer) and ``out/instructor/*.ipynb`` (solutions kept, markers
removed, outputs kept). The notebooks read ``../data`` and write ``../figures``, so an edition
folder sits one level below the repository root: by default ``student/`` and ``instructor/`` at
the root (both ignored by git).

    python scripts/build_editions.py [--out DIR]
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

SOLUTION_LINE = re.compile(r"^(?P<lhs>\s*[^#\n]*?=)\s*(?P<rhs>[^#\n]*?)\s*#\s*SOLUTION\s*$")
BEGIN, END = re.compile(r"^\s*#\s*BEGIN SOLUTION\s*$"), re.compile(r"^\s*#\s*END SOLUTION\s*$")
MD_SOLUTION = re.compile(r"<!--\s*BEGIN SOLUTION\s*-->.*?<!--\s*END SOLUTION\s*-->\n?", re.S)
MARKER_COMMENT = re.compile(r"\s*#\s*SOLUTION\s*$")


def student_code(source: str) -> str:
    """A code cell's source with every solution replaced by ``...``.

    Raises:
        ValueError: a BEGIN SOLUTION without its END SOLUTION, or the other way round.
    """
    out, inside = [], False
    for line in source.split("\n"):
        if BEGIN.match(line):
            if inside:
                raise ValueError("BEGIN SOLUTION inside another solution block")
            inside, indent = True, None
            continue
        if END.match(line):
            if not inside:
                raise ValueError("END SOLUTION without BEGIN SOLUTION")
            out.append(" " * (indent or 0) + "...")
            inside = False
            continue
        if inside:
            if indent is None and line.strip():
                indent = len(line) - len(line.lstrip())
            continue
        m = SOLUTION_LINE.match(line)
        out.append(f"{m['lhs']} ..." if m else line)
    if inside:
        raise ValueError("BEGIN SOLUTION without END SOLUTION")
    return "\n".join(out)


def instructor_code(source: str) -> str:
    """A code cell's source with the solution markers removed (the solutions kept)."""
    lines = [line for line in source.split("\n") if not (BEGIN.match(line) or END.match(line))]
    return "\n".join(MARKER_COMMENT.sub("", line) for line in lines)


def has_solution(nb) -> bool:
    """Whether any cell of the notebook marks a solution."""
    for cell in nb.cells:
        text = cell.source
        if cell.cell_type == "markdown" and MD_SOLUTION.search(text):
            return True
        if cell.cell_type == "code" and any(BEGIN.match(x) or SOLUTION_LINE.match(x) for x in text.split("\n")):
            return True
    return False


def edition(nb, student: bool):
    """A copy of the notebook ``nb`` (nbformat v4) as the student or the instructor edition."""
    nb = nbformat.from_dict(nb)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = MD_SOLUTION.sub("", cell.source) if student else re.sub(
                r"<!--\s*(BEGIN|END) SOLUTION\s*-->\n?", "", cell.source)
        elif cell.cell_type == "code":
            cell.source = student_code(cell.source) if student else instructor_code(cell.source)
            if student:
                cell.outputs, cell.execution_count = [], None
    return nb


def build(source: Path, out: Path) -> list[Path]:
    """Write both editions of every notebook in ``source`` to ``out/student`` and
    ``out/instructor``; returns the written paths."""
    written = []
    for path in sorted(Path(source).glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for name, student in (("student", True), ("instructor", False)):
            target = Path(out) / name / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(edition(nb, student), target)
            written.append(target)
    return written
