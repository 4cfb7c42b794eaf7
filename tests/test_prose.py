"""Prose agrees with outputs (minibatch_course/prose.py): every notebook's markdown numbers are printed or set by
its cells, no ratio below 1 is called "lower", no builders' jargon, every cited file exists; and each contradiction
found in a review of the course is a regression case the scanner must catch."""

import json
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from minibatch_course.links import anchor, broken_links, missing_cited_paths
from minibatch_course.prose import (flat_cost_called_compute_bound, jargon, missing_paths, unbacked_numbers,
                                    wrong_direction)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the Markdown pages a student reads

# Numbers quoted from papers or public specifications (not measured here), per notebook, each with its source.
QUOTED = {
    "00_tour": set(),
    "01_static_batching": set(),
    "02_iteration_batching": set(),
    "03_selective_batching": set(),
    "04_paged_kv": set(),  # vLLM §7.3's block sizes are backed by minibatch.claims (the sentence names the paper)
    "05_chunked_prefill": set(),
    "06_speculative_decoding": set(),
    "07_benchmarks": set(),
    "08_serving_lab": set(),
    "09_wrap_up": set(),
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_prose_agrees_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    problems = (unbacked_numbers(nb, quoted=QUOTED.get(path.stem, set())) + wrong_direction(nb) + jargon(nb)
                + missing_paths(nb, ROOT))
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def notebook(*cells):
    """A notebook from ("md", text) and ("code", source, printed output) tuples."""
    made = []
    for kind, text, *out in cells:
        if kind == "md":
            made.append(new_markdown_cell(text))
        else:
            made.append(new_code_cell(text, outputs=[new_output("stream", text=o) for o in out]))
    return new_notebook(cells=made)


# The review's contradictions, each as the prose said it beside what the cells printed.
CONTRADICTIONS = {
    "04 slots the run did not use": notebook(
        ("md", "A trace of 32 requests at 400, 512 and 768 slots, where Orca runs out first."),
        ("code", "sweep = waste_sweep(n_slots=(1536,))", "n_slots 1536: orca 12 requests, paged 21\n")),
    "04 orca_max reservation": notebook(
        ("md", "Every request reserves prompt + 2048 slots (orca_max)."),
        ("code", "run(trace, reserve_new_tokens=256)", "orca_max  waste 0.61\n")),
    "05 adaptive chunker placed between the wrong budgets": notebook(
        ("md", "The adaptive chunker (ITL p99 150 ms) sits between chunked-128 (104 ms) and chunked-256 (187 ms)."),
        ("code", "print_table(sweep)", "chunked-128  ITL p99 98.9\nchunked-256  ITL p99 199.0\n"
                                       "adaptive-200ms  ITL p99 203.8\n")),
    "05 a ratio below 1 called lower": notebook(
        ("code", "print_acceptance(rows)", "chunked-256      ITL p99 0.84x lower, TPOT p99 3.29x lower\n")),
    "06 v beside a different output": notebook(
        ("code", "print(f'this CPU: v = {v:.2f}')", "this CPU: v = 1.47, c = 0.291\n"),
        ("md", "On this 2-core CPU a verify forward costs v ≈ 1.8 decodes.")),
    "07 requests per point": notebook(
        ("md", "## 5 · Rate sweeps\n\n1000 requests per point, on two clocks."),
        ("code", "scale = json.loads(path.read_text())\nprint(scale['num_requests'])", "600\n")),
    "07 Orca said to match paged at half its capacity": notebook(
        ("code", "print_capacity(rows)", "orca   capacity 0.6 req/s\npaged  capacity 1.2 req/s\n"),
        ("md", "Orca's oracle reservation serves 1.1 req/s, which matches paged.")),
}
JARGON_CASES = ["Speedup vs the issue's target", "as issue 7 asked", "see the issue's closing note",
                "(seed: 3.1x and 1.5x)", "the seed claims 2x", "15% acceptance, the 10% goal",
                "target 1.3x met: False"]


@pytest.mark.parametrize("name", CONTRADICTIONS)
def test_the_scanner_catches_each_contradiction_of_the_review(name):
    nb = CONTRADICTIONS[name]
    assert unbacked_numbers(nb) + wrong_direction(nb), name


def test_the_scanner_accepts_rounded_numbers_percentages_and_parameters():
    nb = notebook(("code", "trace = make_trace(64, rate_per_s=2.0)", "TTFT p99 0.812 s, utilization 0.5938\n"),
                  ("md", "64 requests at 2.0 requests/s: TTFT p99 about 0.8 s; utilization 59.4%, 59%."))
    assert unbacked_numbers(nb) == [] and wrong_direction(nb) == []


@pytest.mark.parametrize("text", JARGON_CASES)
def test_the_scanner_catches_builders_words(text):
    assert jargon(notebook(("md", text))), text


def test_field_words_are_not_jargon():
    nb = notebook(("md", "The acceptance rate of drafts; a target model; a random seed of 0; learning goals."))
    assert jargon(nb) == []


def test_cited_files_must_exist():
    nb = notebook(("md", "See `minibatch/engine.py` and `../data/cpu/spec_decode.json`, not `docs/design_notes.md`."))
    assert missing_paths(nb, ROOT) == ["cell 0: `docs/design_notes.md` is not in the repository"]


@pytest.mark.parametrize("page", [*PAGES, ROOT / "CHANGELOG.md"], ids=lambda p: p.name)
def test_every_link_and_cited_file_of_a_page_exists(page):
    """README's long measurement logs live in docs/ (performance.md, simulator.md); a page moved or a heading
    renamed must not leave a link or a cited file leading nowhere."""
    text = page.read_text()
    problems = broken_links(text, page.parent, ROOT) + missing_cited_paths(text, ROOT)
    assert not problems, "\n".join(problems)


def test_the_link_check_catches_a_missing_page_a_missing_anchor_and_a_way_out():
    text = ("[a](docs/terms.md) [b](docs/gone.md) [c](README.md#quick-start) [d](README.md#no-such-part) "
            "[e](#local) [f](../../etc/passwd) [g](https://example.org/x#y) `data/none.json`\n## Local\n")
    assert broken_links(text, ROOT, ROOT) == ["link (docs/gone.md): no such file in the repository",
                                              "link (README.md#no-such-part): no heading with that anchor",
                                              "link (../../etc/passwd): no such file in the repository"]
    assert missing_cited_paths(text, ROOT) == ["`data/none.json` is not in the repository"]
    assert anchor("The main job: `python -m minibatch compare`") == "the-main-job-python--m-minibatch-compare"


def test_readme_and_notebook_04_say_their_paged_kv_numbers_are_two_runs():
    """The review found README and notebook 04 giving different numbers for "the same setup"; both now say that
    the notebook reads a second, separate run (wall clock numbers differ run to run)."""
    readme = (ROOT / "README.md").read_text()
    nb04 = "".join(c.source for c in nbformat.read(ROOT / "notebooks/04_paged_kv.ipynb", as_version=4).cells)
    assert "Notebook 04 reads a second, separate run of the same setup" in readme
    assert "second, separate run" in nb04


# The course's sentences that called a flat cost compute-bound (before notebook 00's measured cost story), and the
# regimes named right: flat = memory-bound (the weight read), growing in proportion = compute-bound.
FLAT_CALLED_COMPUTE_BOUND = {
    "07 c4": "on this CPU a 1-token decode is a\nmemory-bound matrix-vector product, and 2..16 tokens cost almost "
             "the same compute-bound matrix\nproduct (on a GPU the flat part reaches hundreds of tokens).",
    "07 c38": "Batch 2 is the bad deal: a 1-token step is a memory-bound matrix-vector product (57 ms in\ncurve(N)), a "
              "2-token step already pays for the compute-bound matrix product (89 ms) that 16 tokens\nbarely exceed "
              "(126 ms), so batch 2 buys 2x the tokens for 1.6x the time, batch 16 16x for 2.2x.",
    "06 c19": "*better* than batch 1: on this CPU a matrix multiply over 4 rows costs about what it costs over "
              "12\n(both run compute-bound on one core), so verifying 3 tokens for each of 4 requests is nearly "
              "free\nnext to a 4-row decode, while at batch 1 the decode is a cheap memory-bound 1-row product.",
    "05 c22": "On a 2-core CPU everything is compute-bound: a prefill token\ncosts about as much in a chunk as in a "
              "whole prefill, so chunking cannot make the prefill work\ncheaper.",
}
REGIMES_RIGHT = [
    "Up to the ridge point the bound is flat: the step is memory-bound, its time is the time to read the weights.",
    "Past the ridge the step is compute-bound and its time grows in proportion to the tokens.",
    "With many requests decoding together, a step is already compute-bound: verifying k+1 tokens per request then "
    "costs nearly k+1 times a plain decode.",
    "From 4 to 16 tokens it grows far more slowly than the tokens, the memory-bound part.",
]


@pytest.mark.parametrize("name", FLAT_CALLED_COMPUTE_BOUND)
def test_the_scanner_flags_a_flat_cost_called_compute_bound(name):
    assert flat_cost_called_compute_bound(FLAT_CALLED_COMPUTE_BOUND[name]), name


@pytest.mark.parametrize("text", REGIMES_RIGHT)
def test_the_regimes_named_right_pass(text):
    assert flat_cost_called_compute_bound(text) == []


def test_no_flat_cost_is_called_compute_bound_in_the_course():
    texts = [(f"{p.stem} cell {i}", c.source) for p in NOTEBOOKS  # solutions too
             for i, c in enumerate(nbformat.read(p, as_version=4).cells) if c.cell_type == "markdown"]
    texts += [(page.name, page.read_text()) for page in PAGES]
    problems = [f"{where}: {p}" for where, text in texts for p in flat_cost_called_compute_bound(text)]
    assert not problems, "\n".join(problems)


def test_every_committed_result_names_where_its_command_wrote_it():
    """A committed JSON whose command wrote another path (a scratch file, an older name) says so in a ``note``, so
    the command a reader copies from it is the one that ran and the file's name is explained, not silently moved."""
    moved = []
    for path in sorted((ROOT / "data").rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        command = data.get("command") if isinstance(data, dict) else None
        if isinstance(command, str) and "--json" in command and "note" not in data:
            if str(path.relative_to(ROOT)) not in command:
                moved.append(f"{path.relative_to(ROOT)}: {command[:120]}")
    assert not moved, "\n".join(moved)
