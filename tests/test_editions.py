"""Student and instructor editions built from one source (minibatch_course/editions.py), and the
exercise checks (minibatch/lessons/exercise.py): a student's notebook runs top to bottom with every
check saying "not yet"; the instructor's is the source (replayed by nbval) without the markers."""

import os
from pathlib import Path

import nbformat
import pytest

from minibatch.lessons import exercise
from minibatch_course.editions import build, edition, has_solution, instructor_code, student_code

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
COURSE = [p for p in NOTEBOOKS if p.stem != "00_tour"]  # every chapter after the tour has an exercise


def test_solution_lines_and_blocks_become_stubs():
    src = ("n = 3\nmy_answer = sum(x for x in y)  # SOLUTION\ndef f(a):\n    # BEGIN SOLUTION\n"
           "    b = a + 1\n\n    return b\n    # END SOLUTION\nprint(f(n))")
    assert student_code(src) == "n = 3\nmy_answer = ...\ndef f(a):\n    ...\nprint(f(n))"
    assert instructor_code(src) == ("n = 3\nmy_answer = sum(x for x in y)\ndef f(a):\n    b = a + 1\n\n"
                                    "    return b\nprint(f(n))")
    assert student_code("a = 1  # a SOLUTION-free comment") == "a = 1  # a SOLUTION-free comment"


@pytest.mark.parametrize("src", ["# BEGIN SOLUTION\nx = 1", "x = 1\n# END SOLUTION",
                                 "# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION"])
def test_unbalanced_markers_are_refused(src):
    with pytest.raises(ValueError, match="SOLUTION"):
        student_code(src)


def test_markdown_solutions_and_outputs_are_removed_from_the_student_edition():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("Predict.\n<!-- BEGIN SOLUTION -->\nIt is 26.\n<!-- END SOLUTION -->\nNext."),
        nbformat.v4.new_code_cell("x = 26  # SOLUTION\nprint(x)",
                                  outputs=[nbformat.v4.new_output("stream", text="26\n")])])
    student, instructor = edition(nb, student=True), edition(nb, student=False)
    assert student.cells[0].source == "Predict.\nNext." and student.cells[1].outputs == []
    assert student.cells[1].source == "x = ...\nprint(x)"
    assert instructor.cells[0].source == "Predict.\nIt is 26.\nNext."
    assert instructor.cells[1].source == "x = 26\nprint(x)" and instructor.cells[1].outputs


def test_checks_print_one_line_and_never_raise(capsys):
    @exercise.check(hint="count the rows")
    def check_rows(answer):
        answer = exercise.require(answer, "my_answer")
        assert answer == 26, f"you said {answer}, the engine computed 26"
        return "26 padding rows"

    def raises():
        raise KeyError("oops")

    assert not check_rows(...) and not check_rows(None) and not check_rows(25)
    assert check_rows(26)
    assert not exercise.check()(lambda: raises())()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["not yet: my_answer is not implemented yet. Hint: count the rows",
                     "not yet: my_answer is not implemented yet. Hint: count the rows",
                     "not yet: you said 25, the engine computed 26. Hint: count the rows",
                     "correct: 26 padding rows", "not yet: your code raised KeyError: 'oops'"]


@pytest.mark.parametrize("path", COURSE, ids=lambda p: p.stem)
def test_every_course_notebook_has_a_marked_exercise_and_a_check(path):
    nb = nbformat.read(path, as_version=4)
    assert has_solution(nb), f"{path.name}: no exercise marks its solution (# SOLUTION / # BEGIN SOLUTION)"
    assert CHECKS(nb) > 0, f"{path.name}: no exercise check printed 'correct:' in the instructor edition"


def CHECKS(nb) -> int:
    """How many lines of the notebook's outputs start with "correct:" (the checks that passed)."""
    return sum(line.startswith(exercise.CORRECT) for line in outputs(nb).splitlines())


def outputs(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


@pytest.mark.parametrize("path", COURSE, ids=lambda p: p.stem)
def test_the_student_edition_runs_to_the_end_and_every_check_says_not_yet(path, tmp_path):
    from nbclient import NotebookClient

    build(ROOT / "notebooks", tmp_path)  # tmp/student, tmp/instructor; ../data is the repository's
    (tmp_path / "data").symlink_to(ROOT / "data")
    student = nbformat.read(tmp_path / "student" / path.name, as_version=4)
    env = {"OMP_NUM_THREADS": "2", "TRITON_INTERPRET": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(student, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path / "student")}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    lines = outputs(student).splitlines()
    expected = CHECKS(nbformat.read(path, as_version=4))
    assert not [x for x in lines if x.startswith(exercise.CORRECT)], "a check passed on a stub"
    assert sum(x.startswith(exercise.NOT_YET) for x in lines) == expected, "\n".join(lines[-30:])
