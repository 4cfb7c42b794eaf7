"""Every number this project credits to a paper or an article, with its source: one table.

Notebooks, README, ``docs/terms.md`` and the benchmark JSONs print or store a paper's number only
from here (JSON files store the claim's id, :func:`claim` gives it back). A claim names its source
(title, authors or publisher, year), where in the source the number stands (abstract, section,
table, figure), the hardware and model it was measured on, and whether it is the source's headline
(its abstract or title) or a detail. ``tests/test_claims.py`` scans the notebooks' prose and printed
outputs, README and the glossary: a number in the same sentence or table cell as a source's name
fails unless this table gives that number to that source.

Sources that are not papers say so (``kind``): a blog post's or a community article's numbers are
its authors' measurements on their own setup, quoted here as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Source:
    """A paper, blog post or article. ``aliases``: how prose names it (a sentence holding one of
    them credits its numbers to this source); ``kind``: "paper", "preprint", "blog" or "article"."""

    key: str
    title: str
    authors: str
    year: int
    venue: str
    kind: str
    aliases: tuple[str, ...]


@dataclass(frozen=True)
class Claim:
    """One number (or a few that belong together) a source reports. ``numbers``: every number of
    ``text`` as it may be quoted (a ratio and the values it is computed from); ``where``: section,
    table or figure; ``headline``: stated in the source's abstract or title."""

    id: str
    source: str
    text: str
    numbers: tuple[float, ...]
    where: str
    hardware: str
    model: str
    headline: bool
    values: dict = field(default_factory=dict)  # the numbers a figure or a table computes with, by name

    def cite(self) -> str:
        """``text (authors, "title", venue year, where; model on hardware)``: how notebooks print a claim."""
        s = SOURCES[self.source]
        return (f"{self.text} ({s.authors}, \"{s.title}\", {s.venue} {s.year}, {self.where}; {self.model} on "
                f"{self.hardware})")


SOURCES = {s.key: s for s in [
    Source("orca", "Orca: A Distributed Serving System for Transformer-Based Generative Models",
           "Yu et al.", 2022, "OSDI", "paper", ("OSDI'22", "Yu et al.", "Orca paper")),
    Source("vllm", "Efficient Memory Management for Large Language Model Serving with PagedAttention",
           "Kwon et al.", 2023, "SOSP", "paper", ("SOSP'23", "Kwon et al.", "vLLM paper")),
    Source("vllm-blog", "vLLM: Easy, Fast, and Cheap LLM Serving with PagedAttention", "the vLLM team (Kwon et al.)",
           2023, "vLLM blog, 20 June", "blog", ("vLLM blog", "vLLM's launch post")),
    Source("sarathi-serve", "Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve",
           "Agrawal et al.", 2024, "OSDI", "paper", ("Sarathi-Serve", "Agrawal et al.", "OSDI'24")),
    Source("leviathan", "Fast Inference from Transformers via Speculative Decoding", "Leviathan, Kalman and Matias",
           2023, "ICML", "paper", ("Leviathan", "ICML'23")),
    Source("chen", "Accelerating Large Language Model Decoding with Speculative Sampling", "Chen et al. (DeepMind)",
           2023, "arXiv preprint", "preprint", ("Chen et al.",)),
    Source("anyscale", "How continuous batching enables 23x throughput in LLM inference while reducing p50 latency",
           "Daniel, Shen, Liang and Liaw (Anyscale)", 2023, "Anyscale blog", "blog", ("Anyscale", "Daniel et al.")),
    Source("cann-article", "Continuous Batching: from static padding to dynamic scheduling, 10x throughput "
           "(on cann-recipes-infer)", "a community article", 2026, "web article", "article",
           ("cann-recipes-infer", "Ascend")),
    Source("winechord-028", "LLM inference from scratch, 028: Prefill Micro-Batching", "WineChord's blog", 2025,
           "personal blog", "blog", ("WineChord",)),
]}

CLAIMS = {c.id: c for c in [
    Claim("orca-throughput", "orca", "36.9x the throughput of NVIDIA FasterTransformer (request-level batching) at "
          "the same latency: 6.81 vs 0.185 req/s at a median normalized latency of 190 ms", (36.9, 6.81, 0.185, 190),
          "abstract; §6.2, Figure 10", "16 A100 40GB GPUs (2 Azure VMs)",
          "a GPT-3 175B-sized configuration, synthetic trace", True),
    Claim("vllm-throughput", "vllm", "2-4x the throughput of FasterTransformer and Orca at the same latency",
          (2, 4), "abstract; §6.2", "Google Cloud A100 GPUs (1x40GB for 13B .. 8x80GB for 175B)",
          "OPT-13B/66B/175B and LLaMA-13B, ShareGPT and Alpaca traces", True),
    Claim("vllm-kv-used", "vllm", "only 20.4%-38.2% of the KV cache memory holds token states in existing systems "
          "(Orca with max, power-of-2 and oracle reservations): 61.8%-79.6% wasted; vLLM uses 96.3% (3.7% wasted)",
          (20.4, 38.2, 61.8, 79.6, 96.3, 3.7), "§1 and Figure 2 (the experiment of §6.2)", "an A100 GPU",
          "OPT-13B, ShareGPT trace", False,
          values={"existing_systems_used": (0.204, 0.382), "vllm_used": 0.963}),
    Claim("vllm-swap-vs-recompute", "vllm", "recomputation's overhead is never above 20% of swapping's latency, and "
          "for medium block sizes from 16 to 64 the two give comparable end-to-end performance", (20, 16, 64),
          "§7.3, Figure 19", "one A100 40GB (the 13B setup of §6.1)", "OPT-13B, ShareGPT trace", False),
    Claim("vllm-blog-waste", "vllm-blog", "existing systems waste 60%-80% of KV memory; PagedAttention wastes "
          "under 4%", (60, 80, 4), "the post's section on PagedAttention", "not stated for these numbers",
          "not stated for these numbers", False),
    Claim("sarathi-capacity", "sarathi-serve", "2.6x the serving capacity of vLLM for Mistral-7B on one A100, up to "
          "3.7x for Yi-34B on two A100s, and up to 5.6x end-to-end for Falcon-180B with pipeline parallelism, "
          "each under a P99 TBT (time between tokens) SLO", (2.6, 3.7, 5.6),
          "abstract; §5 (capacity under the P99 TBT SLOs of Table 3)", "A100 80GB GPUs (1, 2 and 8)",
          "Mistral-7B, Yi-34B, Falcon-180B", True),
    Claim("leviathan-speedup", "leviathan", "2-3x faster than the standard T5X implementation, identical outputs "
          "(up to 3.4x with a T5-small draft)", (2, 3, 3.4), "abstract; §4.1, Table 2",
          "one TPU-v4, batch size 1", "T5-XXL (11B) with T5-small/base/large drafts", True,
          values={"speedup": (2.0, 3.0)}),
    Claim("leviathan-alpha", "leviathan", "per-token acceptance alpha 0.53-0.82 with T5-small, -base and -large "
          "drafts (greedy and sampled)", (0.53, 0.82), "§4.2, Table 3", "one TPU-v4", "T5-XXL (11B)", False,
          values={"alpha": (0.53, 0.82)}),
    Claim("chen-speedup", "chen", "2-2.5x decoding speedup in a distributed setup (1.92x, 2.01x and 2.46x measured)",
          (2, 2.5, 1.92, 2.01, 2.46), "abstract; §6.1, Table 1", "16 TPU v4 chips",
          "Chinchilla 70B with a 4B draft", True, values={"speedup": (2.0, 2.5)}),
    Claim("anyscale-continuous", "anyscale", "23x throughput over static (naive) batching with continuous batching "
          "and vLLM's memory optimisations; 8x with continuous batching alone (Ray Serve, TGI)", (23, 8),
          "the post's summary and results", "one NVIDIA A100 40GB GPU", "OPT-13B", True),
    Claim("cann-static-vs-continuous", "cann-article", "static batching (batch 64) 44.2 req/s vs continuous "
          "batching 482 req/s: 10.9x", (44.2, 482, 10.9, 64), "its results table",
          "8 Ascend 910 NPUs (as the article states)", "a model it does not name", True),
    Claim("cann-chunked-tpot", "cann-article", "chunked prefill: TPOT 4187 ms -> 204 ms, throughput -3%",
          (4187, 204, 3), "its results table", "8 Ascend 910 NPUs (as the article states)",
          "a model it does not name", False),
    Claim("winechord-micro-batching", "winechord-028", "prefill micro-batching: TTFT p50 405.64 -> 132.30 ms (3.1x), "
          "throughput 169.79 -> 258.81 tok/s (1.5x)", (3.1, 1.5, 405.64, 132.30, 169.79, 258.81, 32, 8),
          "its results", "a CPU", "HF GPT-2, 32 requests x 8 new tokens", True),
]}


def claim(claim_id: str) -> Claim:
    """The claim with this id.

    Raises:
        KeyError: an unknown id (the message lists the known ones).
    """
    if claim_id not in CLAIMS:
        raise KeyError(f"unknown claim {claim_id!r}; known: {', '.join(CLAIMS)}")
    return CLAIMS[claim_id]


def numbers_of(source: str) -> set[float]:
    """Every number the table gives to ``source`` (a key of :data:`SOURCES`): its claims' ``numbers`` and
    the numbers in their hardware and model ("16 A100 40GB GPUs" gives 16) and in the source's title."""
    import re

    given = {n for c in CLAIMS.values() if c.source == source for n in c.numbers}
    described = f"{SOURCES[source].title} " + " ".join(f"{c.hardware} {c.model}" for c in CLAIMS.values()
                                                       if c.source == source)
    return given | {float(m) for m in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\d.])", described)}


def names(sentence: str) -> set[str]:
    """The keys of the sources ``sentence`` names by one of their aliases (case-insensitive)."""
    low = sentence.lower()
    return {key for key, s in SOURCES.items() if any(a.lower() in low for a in s.aliases)}
