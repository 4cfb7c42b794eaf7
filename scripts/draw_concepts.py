"""Draw every concept figure (minibatch_course/concepts) to figures/concept_<name>.png.

    python scripts/draw_concepts.py            # all of them
    python scripts/draw_concepts.py course_map # one
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minibatch_course import concepts  # noqa: E402

FIGURES = Path(__file__).resolve().parents[1] / "figures"


def main(names: list[str]) -> None:
    for name in names or concepts.names():
        fig = concepts.draw(name)
        path = FIGURES / f"concept_{name}.png"
        fig.savefig(path, dpi=110, metadata={"Software": None})
        plt.close(fig)
        print(path.relative_to(FIGURES.parent))


if __name__ == "__main__":
    main(sys.argv[1:])
