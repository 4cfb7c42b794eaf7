"""Build the student and instructor editions of the notebooks (see minibatch_course/editions.py).

    python scripts/build_editions.py [--out DIR]      (default: student/ and instructor/ at the repo root)
"""

import argparse
from pathlib import Path

from minibatch_course.editions import build

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT), help="folder that gets student/ and instructor/")
    args = parser.parse_args()
    if not (Path(args.out) / "data").is_dir():  # an edition's notebooks read ../data (and write ../figures)
        link = f"ln -s {ROOT / 'data'} {Path(args.out) / 'data'}"
        parser.error(f"--out {args.out}: the notebooks read ../data, so this folder must hold data/: use the "
                     f"repository's root (the default), or link it first ({link})")
    paths = build(ROOT / "notebooks", Path(args.out))
    print(f"wrote {len(paths)} notebooks under {Path(args.out) / 'student'} and {Path(args.out) / 'instructor'}")
