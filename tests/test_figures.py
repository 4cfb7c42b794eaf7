"""Every figure in figures/ has exactly one writer, and a notebook's figure is the image the notebook shows.

Writers: a notebook cell that calls ``show(fig, "NAME", ...)`` (or ``save``) with the name as a literal, the
concept script (``scripts/draw_concepts.py``: ``concept_<module>`` for each module of minibatch_course/concepts)
the main job's report (``compare_*``, minibatch/report.py) or a committed command whose JSON names the figure
(``step_profile``: ``python -m minibatch profile --figure``). A notebook-written PNG must equal, byte for byte,
the inline image of the cell that wrote it: the committed file and the committed notebook come from one run.
"""

import base64
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = sorted((ROOT / "figures").glob("*.png"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CONCEPTS = {p.stem for p in (ROOT / "minibatch_course/concepts").glob("*.py") if not p.stem.startswith("_")}
REPORT = set(re.findall(r'save\([^,]+, "(compare_\w+)"', (ROOT / "minibatch/report.py").read_text()))
# figures written by a committed command (its JSON records the command and the figure)
COMMANDS = {"step_profile": "data/cpu/step_profile.json", "step_profile_cuda": "data/gpu/step_profile_sdpa_h100.json",
            **{f"step_profile_{b}_h200": f"data/gpu/step_profile_{b}_h200.json" for b in ("sdpa", "triton")}}


def notebook_writers() -> dict[str, list[tuple[str, int, list[bytes]]]]:
    """figure name -> [(notebook, cell index, the cell's inline PNGs)] for every cell that writes it."""
    writers = {}
    for path in NOTEBOOKS:
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type != "code":
                continue
            images = [base64.b64decode(o["data"]["image/png"]) for o in cell.get("outputs", [])
                      if "image/png" in o.get("data", {})]
            for name in re.findall(r"\b(?:show|save)\([^\n]*?[\"'](\w+)[\"']", cell.source):
                writers.setdefault(name, []).append((path.stem, i, images))
    return writers


WRITERS = notebook_writers()


@pytest.mark.parametrize("png", FIGURES, ids=lambda p: p.stem)
def test_every_figure_has_exactly_one_writer(png):
    found = [f"{nb} cell {i}" for nb, i, _ in WRITERS.get(png.stem, [])]
    found += ["scripts/draw_concepts.py"] * (png.stem.removeprefix("concept_") in CONCEPTS and
                                             png.stem.startswith("concept_"))
    found += ["minibatch/report.py"] * (png.stem in REPORT)
    if png.stem in COMMANDS:
        import json

        record = json.loads((ROOT / COMMANDS[png.stem]).read_text())
        assert record["figure"] == f"figures/{png.name}" and f"--figure figures/{png.name}" in record["command"]
        found.append(record["command"])
    assert len(found) == 1, f"{png.name}: written by {found or 'nothing in the repository'}"


@pytest.mark.parametrize("name", sorted(WRITERS), ids=str)
def test_a_notebook_figure_is_the_image_the_notebook_shows(name):
    (nb, i, images), = WRITERS[name]  # one writer (above)
    png = ROOT / "figures" / f"{name}.png"
    assert png.exists(), f"{nb} cell {i} writes {png.name}, which is not committed"
    assert png.read_bytes() in images, (f"{png.name} differs from the image {nb} cell {i} shows: display the saved "
                                        "file (minibatch.viz.show) and commit both from the same run")
