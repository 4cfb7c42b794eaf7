"""Concept figures: the one picture each notebook opens with, drawn before any of its code runs.

Each module here draws one figure with ``draw() -> matplotlib.figure.Figure`` from hand-set numbers (no model, no
engine run), so the picture is the idea itself. ``python scripts/draw_concepts.py`` saves every figure to
``figures/concept_<module>.png``; a notebook shows it in its second cell as a markdown image.
"""

import importlib
import pkgutil


def names() -> list[str]:
    """The concept modules, sorted: each is a figure ``figures/concept_<name>.png``."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def draw(name: str):
    """The figure of concept module ``name``. Raises ValueError for an unknown name."""
    if name not in names():
        raise ValueError(f"concept must be one of {names()}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}").draw()


def cell_legend(fig, labels: dict[str, str]) -> None:
    """A figure legend under the axes for Gantt cell kinds (keys of ``minibatch.viz.plots.PALETTE``), each with its
    label, in the course's colours and hatches."""
    from matplotlib.patches import Patch

    from minibatch.viz.plots import HATCH, PALETTE

    fig.legend(handles=[Patch(facecolor=PALETTE[k], hatch=HATCH.get(k), edgecolor="white", label=label)
                        for k, label in labels.items()], loc="outside lower center", ncols=len(labels), fontsize=9,
               frameon=False)
