"""Links and cited files in the course's Markdown (README, ``docs/``, the notebooks' markdown cells).

A page that moves or a section that is renamed must not leave a reader at a dead end: every relative link
``[text](path#anchor)`` resolves to a file of the repository and, for a Markdown file, to one of its headings
(GitHub's anchors: the heading in lower case, punctuation dropped, spaces as hyphens); every file cited in
backticks (`` `data/cpu/x.json` ``) exists.
"""

import re
from pathlib import Path

_PATH = re.compile(r"`((?:\.\./)?(?:minibatch|data|tests|benchmarks|notebooks|figures|scripts|docs|examples)/"
                   r"[\w./-]*[\w/])`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: `The main job: `x`` -> 'the-main-job-x'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of every heading in a Markdown text (fenced code blocks skipped)."""
    return {anchor(h) for h in _HEADING.findall(_FENCE.sub("", text))}


def missing_cited_paths(text: str, root: Path) -> list[str]:
    """Files or folders cited in backticks (`minibatch/x.py`, `../data/y.json`) that ``root`` lacks."""
    return [f"`{m.group(1)}` is not in the repository" for m in _PATH.finditer(text)
            if not (root / m.group(1).removeprefix("../")).exists()]


def broken_links(text: str, here: Path, root: Path) -> list[str]:
    """Relative links in ``text`` (a Markdown file or cell in folder ``here``) that lead nowhere in ``root``:
    a missing file, a link out of the repository, or an anchor that no heading of the target has."""
    found = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, hash_ = target.partition("#")
        dest = (here / path).resolve() if path else None
        if dest is not None and (not dest.is_relative_to(root.resolve()) or not dest.exists()):
            found.append(f"link ({target}): no such file in the repository")
        elif hash_ and (dest is None or dest.suffix == ".md"):
            page = dest.read_text() if dest is not None else text
            if hash_ not in anchors(page):
                found.append(f"link ({target}): no heading with that anchor")
    return found
