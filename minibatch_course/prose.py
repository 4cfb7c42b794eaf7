"""Prose that agrees with its outputs: scan a notebook's markdown for numbers no cell printed, and for jargon.

A measured number a student reads must be printed by a cell (or set in its code); prose may repeat it, rounded.
``unbacked_numbers`` lists each number of the markdown that matches nothing the notebook's outputs or code
contain; ``wrong_direction`` finds ratios below 1 called "higher"/"faster" (write 1.19x higher, not 0.84x lower);
``jargon`` finds words of the people who built the course rather than of the field. Run it on a notebook::

    python -m minibatch_course.prose notebooks/04_paged_kv.ipynb

What is skipped: instructor-only solution blocks, inline code, LaTeX, link targets, headings, the **Time.**
estimate, integers up to 10 (counts and small parameters), years, and numbers that are part of a name
(SmolLM2-135M, T5-XXL, H100, fp32, §4.2, "notebook 04", "Algorithm 1").
Numbers quoted from a paper or an article are backed by ``minibatch.claims`` where the sentence names the source
(:func:`cited_numbers`); other quoted numbers are declared by the caller (``quoted=``).
"""

import re
import sys
from pathlib import Path

import nbformat

from minibatch_course.editions import MD_SOLUTION
from minibatch_course.links import broken_links, missing_cited_paths

_SKIP = [re.compile(p, re.S) for p in (
    MD_SOLUTION.pattern,  # instructor-only solution
    r"```.*?```", r"`[^`]*`", r"\$\$.*?\$\$", r"\$[^$]*\$",  # code and LaTeX
    r"\]\([^)]*\)", r"<[^>]+>", r"https?://\S+",  # link targets, html tags, bare URLs
    r"(?m)^#+ [^\n]*$", r"\*\*Time\.\*\*[^\n]*")]  # headings ("## 3 · ..."), the time estimate
_REFERENCE = re.compile(r"(?:§|\b(?:notebooks?|sections?|Algorithm|Figure|Fig\.|Table|Eq\.|equation|cell|version|"
                        r"k|n|top)) ?(?:\d+[,–-] ?| and | or )*$", re.I)
_NUMBER = re.compile(r"(?<![\w.§/+'-])(\d{1,3}(?:[ ,_]\d{3})+(?!\d)|\d+)(\.\d+)?(?=(x|×|%)?(?![\w-]))")
_OUTPUT_NUMBER = re.compile(r"(?<![\w.])-?(\d{1,3}(?:[,_ ]\d{3})+|\d+)(\.\d+)?(?:e[-+]?\d+)?")
_RATIO_WORD = re.compile(r"(\d+(?:\.\d+)?)\s?[x×] (?:lower|smaller|fewer|less|shorter|slower|higher|faster|larger|"
                         r"more|longer|bigger)\b")
SUMMARY = re.compile(r"#+ (?:What we (?:measured|saw)|Summary|What to take away)", re.I)
JARGON = {
    r"\bissues?\b(?! (?:a|one|each|every|the) (?:request|step|forward|prefill|decode))": "the builders' tracker",
    r"\bclosing note\b": "the builders' notes",
    r"\bthe seed\b|\bseed(?: design| document| claims?| table|:)": "a design document (name the paper)",
    r"\bgoal\b": "a development goal (say what is measured and against what)",
    r"\bacceptance\b(?! (?:rate|length|probabilit|test|criteri|of (?:a |each |the )?drafts?))":
        "acceptance means accepted drafts here; say threshold or tolerance",
    r"\btarget \d+(?:\.\d+)?\s?[x×]": "a development target (say what is compared)",
}


def prose_of(cell) -> str:
    """The markdown a student reads: solution blocks, code, LaTeX, links and headings removed."""
    text = cell.source
    for pattern in _SKIP:
        text = pattern.sub(" ", text)
    return text


def _value(whole: str, frac: str | None) -> float:
    return float(re.sub(r"[ ,_]", "", whole) + (frac or ""))


def evidence(nb, around: int | None = None) -> list[float]:
    """The numbers code cells set or print (text outputs and plain-text results): all of them, or those of the
    code cells near markdown cell ``around``, where prose reads its numbers: the 2 after it, and the 2 before it
    unless it opens a section (a section's prose is about its own cells)."""
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if around is not None:
        before = [] if nb.cells[around].source.startswith("#") else [i for i in code if i < around][-2:]
        code = before + [i for i in code if i > around][:2]
    texts = []
    for cell in (nb.cells[i] for i in code):
        texts.append(cell.source)
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") + out.get("data", {}).get("text/plain", ""))
    return [_value(m.group(1), m.group(2)) for t in texts for m in _OUTPUT_NUMBER.finditer(t)]


def backed(number: float, decimals: int, percent: bool, values: list[float]) -> bool:
    """Whether ``number`` (written with ``decimals`` places) is some value rounded, or a fraction as a percent."""
    scales = (1, 100) if percent else (1,)
    return any(round(abs(v) * s, decimals) == number for v in values for s in scales)


def _prose_numbers(text: str, ranges: bool = False):
    """(match, as written, value) of each number of ``text`` worth checking: not a year, not a reference
    (§4.2, Table 3, "notebook 05"), not part of a name (A100, 7B, GPT-2), and not an integer up to 10 unless
    it carries x, × or % (with ``ranges``, also through a range: "2-4x")."""
    ranged = {m.start(i) for m in _RANGE.finditer(text) for i in (1, 2)} if ranges else set()
    for m in _NUMBER.finditer(text):
        whole, frac, suffix = m.group(1), m.group(2), m.group(3)
        number = _value(whole, frac)
        if _REFERENCE.search(text[max(0, m.start() - 20):m.start()]):
            continue
        if frac is None and (1900 <= number <= 2039 or (number <= 10 and suffix is None and m.start() not in ranged)):
            continue
        yield m, m.group(0) + (suffix or ""), number


def unbacked_numbers(nb, quoted=()) -> list[str]:
    """The markdown's numbers that no output or code of ``nb`` backs, as "cell N: <number> in '...context...'"."""
    found, everything = [], evidence(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        text = prose_of(cell)
        values = everything if SUMMARY.match(cell.source) else evidence(nb, around=i)
        cited = cited_numbers(text)
        for m, token, number in _prose_numbers(text):
            frac, suffix = m.group(2), m.group(3)
            if token in quoted or token in cited or backed(number, len(frac or ".")-1, suffix == "%", values):
                continue
            found.append(f"cell {i}: {token} in '{_context(text, m)}'")
    return found


def wrong_direction(nb) -> list[str]:
    """Ratios below 1 said with a comparative ("0.84x lower"), in prose or printed: which way does it go?"""
    return [f"cell {i}: '{m.group(0)}'" for i, text in _texts(nb) for m in _RATIO_WORD.finditer(text)
            if float(m.group(1)) < 1]


def missing_paths(nb, root: Path) -> list[str]:
    """Files or folders the markdown cites in backticks (`minibatch/x.py`, `../data/y.json`) that ``root`` lacks,
    and links that lead nowhere (``minibatch_course.links``), as "cell N: ..."."""
    return [f"cell {i}: {problem}" for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown"
            for problem in missing_cited_paths(cell.source, root) + broken_links(cell.source, root / "notebooks", root)]


def jargon(nb) -> list[str]:
    """Builders' words in markdown, code or printed text, as "cell N: 'word' (why)"."""
    return [f"cell {i}: '{m.group(0)}' ({why})" for i, text in _texts(nb) for pattern, why in JARGON.items()
            for m in re.finditer(pattern, text, re.I)]


def _texts(nb):
    """(cell index, text) for what a student reads: prose, code, and printed outputs."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            yield i, prose_of(cell)
        else:
            yield i, cell.source
            for out in cell.get("outputs", []):
                yield i, out.get("text", "") + out.get("data", {}).get("text/plain", "")


def _context(text: str, m) -> str:
    return " ".join(text[max(0, m.start() - 40):m.end() + 30].split())


# ---------------------------------------------------------------------------------- claims and their sources
# A sentence ends at . ! ? (or .** or .)) followed by a capital or a bracket (not after "et al."), at a blank
# line, a list item or a table row; a markdown table cell or a printed table's column is its own sentence.
_SENTENCE_END = re.compile(r"(?<!\bal\.)(?:(?<=[.!?])|(?<=[.!?]\*\*)|(?<=[.!?]\)))\s+(?=[A-Z(*\"'])|\n\s*\n|"
                           r"\n(?=\s*[-*] )|\n(?=\s*\|)|\s\|\s?|\|")
_RANGE = re.compile(r"(?<![\w.§/+'-])(\d+(?:\.\d+)?)\s?[-–]\s?(\d+(?:\.\d+)?)\s?(x|×|%)(?![\w-])")


def sentences(text: str, printed: bool = False) -> list[str]:
    """``text`` cut into sentences, list items and table cells (see ``_SENTENCE_END``); ``printed`` output is
    cut into lines, and a printed table whose lines are cut by " | " is read column by column, each column's
    lines joined between its rule lines."""
    lines = text.splitlines()
    column = re.compile(r"\s\|(?:\s|$)")
    if printed and sum(bool(column.search(line)) for line in lines) >= 2:  # a printed table: rebuild its cells
        cells, current = [], {}
        for line in lines + ["---"]:
            if not column.search(line):
                cells += [" ".join(parts) for parts in current.values()]
                current = {}
                continue
            for col, part in enumerate(column.split(line)):
                current.setdefault(col, []).append(part.strip())
        return [c for c in cells if c.strip()]
    if printed:
        return [line for line in lines if line.strip()]
    return [s for s in _SENTENCE_END.split(text) if s and s.strip()]


def quoted_numbers(sentence: str) -> list[tuple[str, float]]:
    """(as written, value) of each number of ``sentence`` that could be a quoted result (see
    :func:`_prose_numbers`), small integers included where a range carries x, × or % ("2-4x")."""
    return [(token, number) for _, token, number in _prose_numbers(sentence, ranges=True)]


def cited_numbers(text: str) -> set[str]:
    """The numbers (as written) that ``text`` quotes from a source it names in the same sentence, where
    ``minibatch.claims`` gives the number to that source: backed by the table, not by an output."""
    cited = set()
    for sentence in sentences(text):
        allowed = _given_to(sentence)[1]
        cited |= {token for token, number in quoted_numbers(sentence) if number in allowed}
    return cited


def _given_to(sentence: str) -> tuple[list[str], set[float]]:
    """The sources ``sentence`` names (sorted keys) and every number the claims table gives them."""
    from minibatch.claims import names, numbers_of

    named = sorted(names(sentence))
    return named, set().union(*(numbers_of(key) for key in named))


def misattributions(text: str, printed: bool = False) -> list[str]:
    """Numbers credited to a source that never reported them: for each sentence naming a source of
    ``minibatch.claims.SOURCES`` (by an alias), each quoted number that no claim of that source holds,
    as "'number' not in <source>'s claims: '...sentence...'". ``printed``: a cell's output (see :func:`sentences`)."""
    found = []
    for sentence in sentences(text, printed):
        named, allowed = _given_to(sentence)
        for token, number in quoted_numbers(sentence) if named else ():
            if number not in allowed:
                found.append(f"'{token}' not in {' or '.join(named)}'s claims: '{' '.join(sentence.split())[:160]}'")
    return found


def unsourced_claims(text: str, printed: bool = False) -> list[str]:
    """Sentences quoting a source's telltale number as the source wrote it, suffix included ("44.2", "4187",
    "36.9x": a claim's decimals of three or more digits and its integers above 300), without naming a
    source the table gives it to. Printed table rows (four numbers or more) are our results, not quotes."""
    from minibatch.claims import CLAIMS, names

    def telltale(n: float) -> bool:
        return n > 300 if n == int(n) else len(re.sub(r"\D", "", f"{n:g}")) >= 3 and n >= 10

    distinctive = {}
    for c in CLAIMS.values():
        for n in c.numbers:
            if telltale(n):
                distinctive.setdefault(n, []).append(c)
    found = []
    for sentence in sentences(text, printed):
        numbers = quoted_numbers(sentence)
        if printed and len(numbers) >= 4:
            continue
        named = names(sentence)
        for token, number in numbers:
            owners = {c.source for c in distinctive.get(number, ())
                      if re.search(rf"(?<![\d.]){re.escape(token)}(?![\w.%×])", c.text)}
            if owners and not owners & named:
                found.append(f"'{token}' is {'/'.join(sorted(owners))}'s number, but the sentence names "
                             f"no source: '{' '.join(sentence.split())[:160]}'")
    return found


# ------------------------------------------------------------------------------------- the roofline's two regimes
# A cost that stays flat as tokens are added is the memory-bound regime (the step's time is reading the weights);
# compute-bound means the time grows in proportion to the tokens (notebook 00, section 7; minibatch/roofline.py).
_COMPUTE_BOUND = re.compile(r"compute[- ]bound", re.I)
_FLAT_COST = re.compile(r"\b(?:flat|(?:almost|about|nearly|roughly) the same|about what it costs|costs? little more|"
                        r"barely (?:grow|exceed|change|more)\w*|(?:almost|nearly) (?:free|for free|nothing))\b", re.I)
_EVERY_STEP = re.compile(r"\b(?:everything|every step|all steps|always)\b[^.]*?compute[- ]bound", re.I)


def flat_cost_called_compute_bound(text: str) -> list[str]:
    """Clauses of ``text`` (sentences cut at , ; : and dashes) that call a flat cost compute-bound, or call every
    step compute-bound (small decode steps are memory-bound on any machine): the regimes named the wrong way round."""
    found = []
    for sentence in sentences(text):
        flat = _EVERY_STEP.search(sentence) or any(
            _COMPUTE_BOUND.search(clause) and _FLAT_COST.search(clause) and not re.search(r"memory[- ]bound", clause)
            for clause in re.split(r"[,;:—]|\s–\s", sentence))
        if flat:
            found.append(" ".join(sentence.split())[:160])
    return found


def main(paths: list[str]) -> int:
    problems = 0
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        root = Path(path).resolve().parents[1]
        for kind, lines in (("unbacked", unbacked_numbers(nb)), ("direction", wrong_direction(nb)),
                            ("jargon", jargon(nb)), ("path", missing_paths(nb, root)),
                            ("regime", [p for c in nb.cells if c.cell_type == "markdown"
                                        for p in flat_cost_called_compute_bound(c.source)])):
            for line in lines:
                print(f"{Path(path).name} {kind} {line}")
            problems += len(lines)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
