"""Workloads: when requests arrive and how long they are, as a reproducible list of Requests.

A trace = arrival times (seconds from the trace start) x (prompt_len, output_len) pairs x prompt
token ids. Arrival processes follow vLLM's ``benchmark_serving``: all at once, Poisson (exponential
gaps, mean 1/rate), or gamma gaps with a coefficient of variation ``cv`` ("burstiness" = 1/cv^2).
Lengths are fixed, uniform, or resampled from real ShareGPT chat turns tokenized with SmolLM2's
tokenizer (``minibatch/data/sharegpt_lengths.json``, built by
``scripts/build_sharegpt_lengths.py``; lengths only, no text).

Everything takes a ``numpy.random.Generator``; :func:`make_trace` derives independent streams
for arrivals, lengths and token ids from one ``seed``, so e.g. switching ``lengths`` keeps the
same arrival times.

Prompt text comes from :mod:`minibatch.prompts`; trace files are written and read by
:mod:`minibatch.trace_io` (``save_trace`` and ``load_trace`` are re-exported here).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from minibatch.prompts import demo_prompts
from minibatch.request import Request, SamplingParams
from minibatch.trace_io import load_trace, save_trace  # noqa: F401 (re-exported: trace files)

DATA_DIR = Path(__file__).resolve().parent / "data"
SHAREGPT_LENGTHS_PATH = DATA_DIR / "sharegpt_lengths.json"
ARRIVALS = ("zero", "poisson", "gamma")
LENGTHS = ("sharegpt", "fixed", "uniform")
MIN_TOKEN_ID = 3  # random prompts avoid the first ids (special tokens in SmolLM2's vocab)


# ---------------------------------------------------------------- validation helpers
def _check_int(x, name: str, minimum: int = 1, allow_none: bool = False) -> None:
    if x is None and allow_none:
        return
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {x!r}")


def _check_positive(x: float, name: str) -> None:
    if not (isinstance(x, (int, float, np.number)) and np.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")


def _check_range(r, name: str) -> tuple[int, int]:
    try:
        lo, hi = r
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (low, high) pair of integers, got {r!r}") from None
    _check_int(lo, f"{name}[0]")
    _check_int(hi, f"{name}[1]")
    if lo > hi:
        raise ValueError(f"{name} must have low <= high, got {r!r}")
    return int(lo), int(hi)


# ---------------------------------------------------------------- arrival processes
def arrivals_at_zero(n: int) -> list[float]:
    """``n`` arrival times, all 0.0 s (an offline batch: everything queued at the start).

    Raises:
        ValueError: n < 1.
    """
    _check_int(n, "n")
    return [0.0] * n


def poisson_arrivals(n: int, rate_per_s: float, rng: np.random.Generator) -> list[float]:
    """``n`` sorted arrival times (s) of a Poisson process: exponential gaps with mean 1/rate.

    The first request arrives after one gap (> 0), as in vLLM's benchmark_serving.

    Raises:
        ValueError: n < 1 or rate_per_s <= 0.
    """
    _check_int(n, "n")
    _check_positive(rate_per_s, "rate_per_s")
    return np.cumsum(rng.exponential(1.0 / rate_per_s, size=n)).tolist()


def gamma_arrivals(n: int, rate_per_s: float, cv: float, rng: np.random.Generator) -> list[float]:
    """``n`` sorted arrival times (s) with gamma-distributed gaps: mean 1/rate, std cv/rate.

    Shape = 1/cv^2 (vLLM's "burstiness"), scale = cv^2/rate. cv = 1 is Poisson; cv > 1 is bursty
    (clumps of near-simultaneous arrivals, then long gaps); cv < 1 is more regular.

    Raises:
        ValueError: n < 1, rate_per_s <= 0 or cv <= 0.
    """
    _check_int(n, "n")
    _check_positive(rate_per_s, "rate_per_s")
    _check_positive(cv, "cv")
    shape = 1.0 / cv**2
    return np.cumsum(rng.gamma(shape, 1.0 / (rate_per_s * shape), size=n)).tolist()


# ---------------------------------------------------------------- length distributions
def fixed_lengths(n: int, prompt_len: int, output_len: int) -> list[tuple[int, int]]:
    """``n`` copies of (prompt_len, output_len), in tokens.

    Raises:
        ValueError: n < 1 or a length < 1.
    """
    _check_int(n, "n")
    _check_int(prompt_len, "prompt_len")
    _check_int(output_len, "output_len")
    return [(int(prompt_len), int(output_len))] * n


def uniform_lengths(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                    rng: np.random.Generator) -> list[tuple[int, int]]:
    """``n`` (prompt_len, output_len) pairs drawn uniformly from the inclusive token ranges.

    Raises:
        ValueError: n < 1, a bound < 1 or low > high.
    """
    _check_int(n, "n")
    plo, phi = _check_range(prompt_range, "prompt_range")
    olo, ohi = _check_range(output_range, "output_range")
    p = rng.integers(plo, phi + 1, size=n)
    o = rng.integers(olo, ohi + 1, size=n)
    return [(int(a), int(b)) for a, b in zip(p, o)]


@functools.lru_cache(maxsize=1)
def load_sharegpt_lengths() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (prompt_lens, output_lens) token lengths stored in ``sharegpt_lengths.json``.

    Raises:
        FileNotFoundError: the data file is missing (run scripts/build_sharegpt_lengths.py).
    """
    if not SHAREGPT_LENGTHS_PATH.exists():
        raise FileNotFoundError(
            f"{SHAREGPT_LENGTHS_PATH} missing: run scripts/build_sharegpt_lengths.py")
    data = json.loads(SHAREGPT_LENGTHS_PATH.read_text(encoding="utf-8"))
    return tuple(data["prompt_lens"]), tuple(data["output_lens"])


def sharegpt_lengths(n: int, rng: np.random.Generator, max_prompt_len: int | None = None,
                     max_output_len: int | None = None) -> list[tuple[int, int]]:
    """``n`` (prompt_len, output_len) pairs resampled (with replacement) from real ShareGPT turns.

    Pairs stay together (a long question tends to get a long answer). Lengths above
    ``max_prompt_len`` / ``max_output_len`` are clipped to that max (None = no cap); lengths below
    1 are raised to 1. Clipping piles mass at the cap: the tail is not resampled.

    Raises:
        ValueError: n < 1 or a max < 1.
    """
    _check_int(n, "n")
    _check_int(max_prompt_len, "max_prompt_len", allow_none=True)
    _check_int(max_output_len, "max_output_len", allow_none=True)
    prompts, outputs = load_sharegpt_lengths()
    idx = rng.integers(0, len(prompts), size=n)
    p = np.clip(np.asarray(prompts)[idx], 1, max_prompt_len)
    o = np.clip(np.asarray(outputs)[idx], 1, max_output_len)
    return [(int(a), int(b)) for a, b in zip(p, o)]


# ---------------------------------------------------------------- traces
def _text_ids(tokenizer, texts: list[str], length: int, start: int) -> list[int]:
    """Ids of texts[start], texts[start+1], ... (cycling, blank-line joined) cut to ``length``."""
    parts: list[str] = []
    k, approx = start, 0
    while True:
        while approx < length:  # cheap estimate from the parts' own lengths, then encode once
            parts.append(texts[k % len(texts)])
            approx += len(tokenizer.encode(parts[-1], add_special_tokens=False)) + 1
            k += 1
        # may exceed model_max_length: cut below
        ids = list(tokenizer.encode("\n\n".join(parts), add_special_tokens=False, verbose=False))
        if len(ids) >= length:
            return ids[:length]
        approx = len(ids)


def make_trace(num_requests: int, *, arrival: str = "poisson", rate_per_s: float = 1.0,
               cv: float = 1.0, lengths: str = "sharegpt", prompt_len: int = 128,
               output_len: int = 128, prompt_range: tuple[int, int] = (16, 256),
               output_range: tuple[int, int] = (16, 256), max_prompt_len: int | None = None,
               max_output_len: int | None = None, output_scale: float = 1.0,
               vocab_size: int = 49152, seed: int = 0,
               sampling: SamplingParams = SamplingParams(ignore_eos=True), tokenizer=None,
               prompts: list[str] | None = None, num_long_prompts: int = 0,
               long_prompt_len: int = 1024) -> list[Request]:
    """A reproducible list of Requests "req-000", "req-001", ... sorted by arrival time.

    Args:
        arrival: "zero" (all at 0 s), "poisson" (rate_per_s requests/s) or "gamma" (rate_per_s,
            with inter-arrival coefficient of variation cv; cv > 1 is burstier).
        lengths: "sharegpt" (real chat turns), "fixed" (prompt_len, output_len) or "uniform"
            (inclusive prompt_range, output_range). All in tokens.
        max_prompt_len, max_output_len: caps applied to every length distribution (longer
            lengths are clipped to the cap); None = no cap.
        output_scale: output lengths are multiplied by this (rounded up) before the cap, so a
            CPU-sized run keeps the *shape* of the ShareGPT distribution (its spread is what
            static batching wastes) instead of piling every long answer at the cap. > 0.
        vocab_size: random prompt ids are drawn from [3, vocab_size) when there is no tokenizer.
        seed: split by ``numpy.random.SeedSequence(seed).spawn(3)`` into three
            ``default_rng`` streams (arrivals, lengths, token ids); same arguments + seed -> the
            same trace, and changing only the length model keeps the arrival times.
        sampling: shared by every request (default greedy with ignore_eos, as vLLM benchmarks).
        tokenizer: if given, prompts are real text: ``prompts`` (default :func:`demo_prompts`)
            encoded, concatenated cyclically and cut to exactly prompt_len tokens; request i
            starts at text i. ``prompt_text`` holds the decoded ids (re-encoding it may give a
            few tokens more or less: the cut can split a word).
        prompts: texts for the tokenizer path (needs ``tokenizer``).
        num_long_prompts, long_prompt_len: the long-prompt trace (Sarathi-Serve's setting: a
            few long prompts among short chats): requests round((k + 0.5) * num_requests /
            num_long_prompts), k = 0 .. num_long_prompts - 1 (spread evenly over the trace),
            get a prompt of exactly long_prompt_len tokens (not clipped by max_prompt_len);
            their output lengths are drawn like the others'.

    Output length becomes ``max_new_tokens`` (with ignore_eos, exactly the tokens generated).

    Raises:
        ValueError: the message names the field: num_requests < 1, rate_per_s <= 0, cv <= 0, a
            length < 1, an unknown arrival/lengths name (lists the allowed ones), vocab_size < 4,
            empty prompts, or prompts without a tokenizer.
    """
    _check_int(num_requests, "num_requests")
    n = int(num_requests)
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    if lengths not in LENGTHS:
        raise ValueError(f"lengths must be one of {LENGTHS}, got {lengths!r}")
    _check_positive(rate_per_s, "rate_per_s")
    _check_positive(cv, "cv")
    _check_positive(output_scale, "output_scale")
    _check_int(max_prompt_len, "max_prompt_len", allow_none=True)
    _check_int(max_output_len, "max_output_len", allow_none=True)
    _check_int(vocab_size, "vocab_size", minimum=MIN_TOKEN_ID + 1)
    _check_int(num_long_prompts, "num_long_prompts", minimum=0)
    _check_int(long_prompt_len, "long_prompt_len")
    if num_long_prompts > n:
        raise ValueError(f"num_long_prompts must be <= num_requests ({n}), got {num_long_prompts}")
    if prompts is not None and tokenizer is None:
        raise ValueError("prompts needs a tokenizer (pass tokenizer=...)")
    if prompts is not None and not (prompts and all(isinstance(t, str) and t for t in prompts)):
        raise ValueError("prompts must be a non-empty list of non-empty strings")

    seeds = np.random.SeedSequence(seed).spawn(3)
    rng_arr, rng_len, rng_tok = (np.random.default_rng(s) for s in seeds)
    if arrival == "zero":
        times = arrivals_at_zero(n)
    elif arrival == "poisson":
        times = poisson_arrivals(n, rate_per_s, rng_arr)
    else:
        times = gamma_arrivals(n, rate_per_s, cv, rng_arr)

    if lengths == "fixed":
        pairs = fixed_lengths(n, prompt_len, output_len)
    elif lengths == "uniform":
        pairs = uniform_lengths(n, prompt_range, output_range, rng_len)
    else:
        pairs = sharegpt_lengths(n, rng_len)
    pairs = [(p, max(1, int(np.ceil(o * output_scale)))) for p, o in pairs]
    pairs = [(min(p, max_prompt_len or p), min(o, max_output_len or o)) for p, o in pairs]
    for k in range(num_long_prompts):
        i = min(n - 1, int((k + 0.5) * n / num_long_prompts))
        pairs[i] = (long_prompt_len, pairs[i][1])

    texts = list(prompts) if prompts is not None else demo_prompts()
    requests = []
    for i, (t, (p, o)) in enumerate(zip(times, pairs)):
        if tokenizer is not None:
            ids = _text_ids(tokenizer, texts, p, start=i)
            text = tokenizer.decode(ids)
        else:
            ids, text = rng_tok.integers(MIN_TOKEN_ID, vocab_size, size=p).tolist(), None
        requests.append(Request(f"req-{i:03d}", ids, max_new_tokens=o, sampling=sampling,
                                arrival_time_s=float(t), prompt_text=text))
    return requests


def build_trace(cfg, tokenizer, vocab_size: int) -> list[Request]:
    """The requests of a ``compare.CompareConfig``: cfg.trace read (token ids checked against ``vocab_size``), or
    the trace its options generate (ShareGPT lengths, ignore_eos).

    Raises:
        ValueError: a bad trace file (names the file, the request index and the field).
    """
    if cfg.trace is not None:
        return load_trace(cfg.trace, vocab_size=vocab_size)
    return make_trace(cfg.num_requests, arrival=cfg.arrival, rate_per_s=cfg.rate, cv=cfg.arrival_cv,
                      lengths="sharegpt", max_prompt_len=cfg.max_prompt_len, max_output_len=cfg.max_output_len,
                      output_scale=cfg.output_scale, vocab_size=vocab_size, num_long_prompts=cfg.long_prompts,
                      long_prompt_len=cfg.long_prompt_len, seed=cfg.seed, sampling=SamplingParams(ignore_eos=True),
                      tokenizer=tokenizer)
