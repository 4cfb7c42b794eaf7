"""Re-execute notebooks in place and strip execution metadata, so nbval has fresh outputs.

    python scripts/run_notebooks.py [notebooks/NN_name.ipynb ...]    (default: all of notebooks/)

Run it after changing code a notebook prints from; then check with
``python -m pytest --nbval notebooks``.
"""

import subprocess
import sys
import time
from pathlib import Path

import nbformat


def strip(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.metadata = {k: v for k, v in nb.metadata.items() if k in ("kernelspec", "language_info")}
    nb.metadata.get("language_info", {}).pop("version", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)


def main(paths: list[str]) -> None:
    root = Path(__file__).resolve().parent.parent
    notebooks = [Path(p) for p in paths] or sorted((root / "notebooks").glob("*.ipynb"))
    for path in notebooks:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                        "--inplace", "--ExecutePreprocessor.timeout=600", str(path)], check=True)
        strip(path)
        print(f"{path.name}: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
