"""Write constraints.txt: the exact version of every package ``minibatch[dev]`` pulls in, as installed
here, so a classroom installs what the course was tested with:

    python scripts/freeze_constraints.py          (after a green `python -m pytest --nbval tests notebooks`)
    pip install -c constraints.txt torch==2.13.0 -e ".[dev]"

Local version labels (torch's "+cpu") are dropped: ``torch==2.13.0`` matches the CPU and CUDA builds.
"""

import importlib.metadata as md
import re
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def closure(name: str, extras: tuple[str, ...] = ()) -> dict[str, str]:
    """Normalized name -> installed version for ``name`` and everything it requires (with ``extras``)."""
    found: dict[str, str] = {}
    todo = [(name, extras)]
    while todo:
        pkg, pkg_extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", pkg).lower()
        if key in found:
            continue
        try:
            dist = md.distribution(pkg)
        except md.PackageNotFoundError:  # an optional dependency for another platform
            continue
        found[key] = dist.version.split("+")[0]
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *pkg_extras)):
                todo.append((req.name, tuple(req.extras)))
    return found


if __name__ == "__main__":
    pins = closure("minibatch", ("dev",))
    pins.pop("minibatch")
    lines = [f"{k}=={v}" for k, v in sorted(pins.items())]
    header = "# Exact versions the course was tested with (python scripts/freeze_constraints.py).\n"
    (ROOT / "constraints.txt").write_text(header + "\n".join(lines) + "\n")
    print(f"wrote constraints.txt: {len(lines)} packages")
