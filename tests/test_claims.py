"""Every number credited to a paper or an article is in ``minibatch.claims`` and credited to the right source.

The scan reads what a student reads (every notebook's markdown and printed outputs, README, docs/terms.md): a
number in the same sentence or table cell as a source's name must be one the table gives that source, and a
source's telltale number (44.2, 4187, 36.9x) must not appear without a source the table gives it to. The
fixtures are sentences the course once printed, each crediting a number to a source that never reported it.
"""

import json
from pathlib import Path

import nbformat
import pytest

from minibatch.claims import CLAIMS, SOURCES, claim, names, numbers_of
from minibatch_course.prose import misattributions, prose_of, unsourced_claims

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

MISATTRIBUTED = [  # as the course printed them, before the claims table
    "Sarathi-Serve (its own setting, a GPU): TPOT 4187 ms -> 204 ms with chunking, throughput -3%",
    "batching prefills: TTFT p50 1.87x lower, output throughput 1.09x (Sarathi-Serve: 3.1x and 1.5x)",
    "**Against the claims.** Sarathi-Serve (in its own setting) reports TPOT 4187 ms → 204 ms with chunking at −3% "
    "throughput, on a GPU.",
    "Batching prefills helps TTFT; on a GPU one prompt leaves most of the device idle, hence Sarathi-Serve's 1.5x.",
    "Continuous vs static batching: 'up to 23x the throughput' (Anyscale blog, Daniel et al., 2023, with vLLM); "
    "static batching bs=64: 44.2 req/s vs continuous batching: 482 req/s (10.9x), the often-quoted table",
    "Chunked prefill: TPOT 4187 -> 204 ms at -3% throughput (Sarathi-Serve, Agrawal et al., OSDI'24)",
]
UNSOURCED = [  # a source's numbers with its name left out
    "claim: static batching bs=64: 44.2 req/s vs continuous batching: 482 req/s (10.9x), the often-quoted table",
    "* **The often-quoted table (10.9x).** Continuous batching beats static batching by keeping the batch full.",
    "* **Orca's 36.9x** was measured against FasterTransformer on GPT-3 175B.",
]
CORRECT = [
    "Orca (OSDI'22 §6.2): 36.9x the throughput of NVIDIA FasterTransformer on 16 A100 GPUs.",
    "Leviathan et al. report 2–3x on T5-XXL (11B) with a T5-small draft, Chen et al. 2–2.5x on Chinchilla 70B.",
    "The vLLM paper (Kwon et al., SOSP'23) reports that only 20.4%-38.2% of the KV cache holds token states.",
    "Our paged waste is 1.9%. Our Orca with an oracle wastes 37%.",
]


@pytest.mark.parametrize("sentence", MISATTRIBUTED)
def test_misattributed_numbers_are_flagged(sentence):
    assert misattributions(sentence) or unsourced_claims(sentence)


@pytest.mark.parametrize("sentence", UNSOURCED)
def test_unsourced_numbers_are_flagged(sentence):
    assert unsourced_claims(sentence)


@pytest.mark.parametrize("sentence", CORRECT)
def test_correctly_sourced_numbers_pass(sentence):
    assert not misattributions(sentence) and not unsourced_claims(sentence)


def test_a_printed_table_is_read_cell_by_cell():
    table = ("claim (source)   | our number\n"
             "-----------------+-----------\n"
             "Chunked prefill: | TPOT p99 2952 -> 435 ms\n"
             "TPOT 4187 -> 204 | (budget 64)\n"
             "ms (Sarathi-     |\n"
             "Serve, OSDI'24)  |\n")
    assert any("'4187' not in sarathi-serve" in p for p in misattributions(table, printed=True))
    assert not any("2952" in p for p in misattributions(table, printed=True))


def test_every_claim_is_complete_and_its_numbers_are_in_its_text():
    for c in CLAIMS.values():
        assert c.source in SOURCES and c.where and c.hardware and c.model
        assert c.source in names(c.cite())  # a printed claim names its source
        for n in c.numbers:
            assert f"{n:g}" in c.text.replace(",", ""), (c.id, n)
    assert claim("sarathi-capacity").headline and 2.6 in numbers_of("sarathi-serve")
    assert 4187 not in numbers_of("sarathi-serve") and 1.5 not in numbers_of("sarathi-serve")
    with pytest.raises(KeyError, match="known"):
        claim("sarathi-4187")


def course_texts():
    """(where, text, printed) for every notebook's markdown and outputs, README and the pages in docs/."""
    for path in NOTEBOOKS:
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "markdown":
                yield f"{path.stem} cell {i}", prose_of(cell), False
            for out in cell.get("outputs", []):
                text = out.get("text", "") + out.get("data", {}).get("text/plain", "")
                if text:
                    yield f"{path.stem} cell {i} output", text, True
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield page.name, page.read_text(), False


def test_the_course_credits_every_number_to_its_source():
    problems = [f"{where}: {p}" for where, text, printed in course_texts()
                for p in misattributions(text, printed) + unsourced_claims(text, printed)]
    assert not problems, "\n".join(problems)


def test_benchmark_files_store_claim_ids_not_numbers():
    for path in ("data/cpu/chunked_prefill.json", "data/cpu/chunked_prefill_burst.json", "data/cpu/paged_kv.json",
                 "data/sim/scale.json"):
        data = json.loads((ROOT / path).read_text())
        assert all(cid in CLAIMS for cid in data["claims"]), path
        assert not {"paper_claims", "vllm_claim"} & set(data)
