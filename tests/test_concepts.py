"""Pictures first: every notebook opens with its concept figure (a markdown image above the first code cell),
drawn by a module of minibatch_course/concepts that runs without a model."""

import re
from pathlib import Path

import matplotlib
import nbformat
import pytest

from minibatch_course import concepts

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
IMAGE = re.compile(r"!\[[^\]]+\]\(\.\./figures/concept_(\w+)\.png\)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_opens_with_a_concept_figure(path):
    nb = nbformat.read(path, as_version=4)
    first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    shown = [m.group(1) for c in nb.cells[:first_code] if c.cell_type == "markdown" for m in IMAGE.finditer(c.source)]
    assert shown, f"{path.name}: no ![alt](../figures/concept_<name>.png) before its first code cell"
    for name in shown:
        assert name in concepts.names(), f"{path.name}: no module minibatch_course/concepts/{name}.py"
        assert (ROOT / "figures" / f"concept_{name}.png").exists(), f"run python scripts/draw_concepts.py {name}"


@pytest.mark.parametrize("name", concepts.names())
def test_every_concept_figure_draws_with_a_legend_or_labels(name):
    fig = concepts.draw(name)
    texts = [t for ax in fig.axes for t in ax.texts] + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert texts, f"{name}: a concept figure explains itself with labels or a legend"
    matplotlib.pyplot.close(fig)


def test_unknown_concept_is_refused():
    with pytest.raises(ValueError, match="concept must be one of"):
        concepts.draw("no_such_figure")
