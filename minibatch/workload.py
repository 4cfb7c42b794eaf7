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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import reprlib
from pathlib import Path

import numpy as np

from minibatch.checks import check_in_vocab
from minibatch.request import Request, SamplingParams

TRACE_FORMAT = "minibatch-trace-v1"
DATA_DIR = Path(__file__).resolve().parent / "data"
SHAREGPT_LENGTHS_PATH = DATA_DIR / "sharegpt_lengths.json"
ARRIVALS = ("zero", "poisson", "gamma")
LENGTHS = ("sharegpt", "fixed", "uniform")
MIN_TOKEN_ID = 3  # random prompts avoid the first ids (special tokens in SmolLM2's vocab)

# Hand-written chat prompts (our own words) so demos run the model on real text.
DEMO_PROMPTS: tuple[str, ...] = (
    "What is the capital of Australia?",
    "Give me three ideas for a rainy Sunday afternoon with kids.",
    "Explain what a hash table is to someone who has never programmed.",
    "Write a haiku about a cat watching snow fall.",
    "Why is the sky blue? Keep it short.",
    "Summarize the following paragraph in one sentence: The town council met on Tuesday to "
    "discuss the new bike lanes on Main Street. Shop owners worried that losing parking would "
    "hurt business, while cyclists said the lanes would make the street safer and bring more "
    "people downtown. After two hours of debate the council agreed to a six-month trial and "
    "will count both bike traffic and shop sales before deciding.",
    "In Python, what is the difference between a list and a tuple, and when should I use each?",
    "My function returns None instead of the sum. What is wrong?\n\n"
    "def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    print(s)\n",
    "Translate to French: 'The train leaves at seven, so please do not be late.'",
    "I have eggs, spinach, an onion and some cheese. What can I cook for dinner in 20 minutes?",
    "Write a polite email to my landlord asking when the broken heater will be repaired. It has "
    "been two weeks and the nights are getting cold.",
    "What are the pros and cons of working from home?",
    "Explain the difference between latency and throughput with an everyday example.",
    "Write a SQL query that returns the five customers who spent the most money last year, "
    "given tables orders(id, customer_id, amount, created_at) and customers(id, name).",
    "Tell me a short story about a robot who learns to garden.",
    "How do vaccines train the immune system? Explain it step by step for a high-school student.",
)


def demo_prompts() -> list[str]:
    """The hand-written demo prompts (16 chat messages of varied length and topic)."""
    return list(DEMO_PROMPTS)


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as a user chat turn, ready for generation.

    Uses the tokenizer's chat template (``add_generation_prompt=True``) when it has one, else a
    plain ``encode``. The template adds tokens (roles, a system prompt), so the length differs
    from ``len(tokenizer.encode(text))``.
    """
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text))


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
        ids = list(tokenizer.encode("\n\n".join(parts), add_special_tokens=False, verbose=False))  # may exceed model_max_length: cut below
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


def save_trace(requests: list[Request], path: str | Path) -> None:
    """Write the requests' inputs (not engine state) as JSON, format "minibatch-trace-v1",
    atomically (:func:`minibatch.files.atomic_write_text`: a failed write keeps the old file).

    One request per line: request_id, prompt_token_ids, max_new_tokens, sampling (the
    SamplingParams fields), arrival_time_s (s), prompt_text (or null), priority (int).

    Raises:
        ValueError: no requests, or a non-finite number (e.g. arrival_time_s = inf) that JSON
            cannot hold and :func:`load_trace` would refuse (names the request).
        OSError: the file cannot be written (the old file is kept).
    """
    from minibatch.files import atomic_write_text

    if not requests:
        raise ValueError("requests must hold >= 1 request (load_trace refuses an empty trace)")
    rows = []
    for r in requests:
        row = {"request_id": r.request_id, "prompt_token_ids": r.prompt_token_ids,
               "max_new_tokens": r.max_new_tokens, "sampling": dataclasses.asdict(r.sampling),
               "arrival_time_s": r.arrival_time_s, "prompt_text": r.prompt_text, "priority": r.priority}
        try:
            rows.append(json.dumps(row, separators=(",", ":"), allow_nan=False))
        except ValueError:
            raise ValueError(f"request {r.request_id!r}: a value is not a finite number "
                             f"(arrival_time_s = {r.arrival_time_s}, sampling = {r.sampling}); JSON cannot hold it") from None
    body = ",\n".join(rows)
    atomic_write_text(path, f'{{"format": "{TRACE_FORMAT}", "requests": [\n{body}\n]}}\n')


# The keys of a trace file; "sampling" holds SamplingParams fields.
TRACE_KEYS = ("format", "requests")
TRACE_REQUEST_KEYS = ("request_id", "prompt_token_ids", "max_new_tokens", "sampling", "arrival_time_s",
                      "prompt_text", "priority")
TRACE_REQUIRED_KEYS = ("request_id", "prompt_token_ids", "max_new_tokens")


def _check_trace_request(row) -> None:
    """The shape of a trace row: an object with known keys, the required ones present, sampling an
    object of SamplingParams fields. Types and ranges of the values are Request's and
    SamplingParams' checks (one place each). Raises ValueError naming the field."""
    if not isinstance(row, dict):
        raise ValueError(f"must be an object with keys {', '.join(TRACE_REQUEST_KEYS)}; got {type(row).__name__}")
    unknown = [k for k in row if k not in TRACE_REQUEST_KEYS]
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(TRACE_REQUEST_KEYS)})")
    missing = [k for k in TRACE_REQUIRED_KEYS if k not in row]
    if missing:
        raise ValueError(f"missing field {missing[0]!r} (required: {', '.join(TRACE_REQUIRED_KEYS)})")
    sampling = row.get("sampling", {})
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    if not isinstance(sampling, dict):
        raise ValueError(f"sampling must be an object with keys among {', '.join(fields)}, "
                         f"got {reprlib.repr(sampling)}")
    unknown = [k for k in sampling if k not in fields]
    if unknown:
        raise ValueError(f"sampling: unknown key(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(fields)})")


def load_trace(path: str | Path, vocab_size: int | None = None) -> list[Request]:
    """Read a trace written by :func:`save_trace` into fresh Requests.

    A trace is ``{"format": "minibatch-trace-v1", "requests": [...]}`` with >= 1 request, each an
    object with request_id (non-empty string, unique), prompt_token_ids (non-empty list of ints
    >= 0, below ``vocab_size`` when given), max_new_tokens (int >= 1), and optionally
    arrival_time_s (finite number >= 0, default 0), sampling (SamplingParams fields), priority
    (int, default 0), prompt_text (string or null). No other keys.

    Raises:
        ValueError: every bad file: missing, a folder, binary, empty, truncated or not JSON, wrong
            top-level type, missing/wrong "format" or "requests", no requests, and any request
            with a missing, unknown, mistyped or out-of-range field or a repeated request_id; the
            message names the file, the request index and the field with its allowed values.
    """
    from minibatch.files import read_json

    data = read_json(path, what="trace")
    if not isinstance(data, dict):
        raise ValueError(f'{path}: a trace must be a JSON object {{"format": "{TRACE_FORMAT}", "requests": [...]}}, '
                         f"got a {type(data).__name__}")
    for key in TRACE_KEYS:
        if key not in data:
            raise ValueError(f"{path}: missing key {key!r} (a trace is "
                             f'{{"format": "{TRACE_FORMAT}", "requests": [...]}})')
    unknown = [k for k in data if k not in TRACE_KEYS]
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(TRACE_KEYS)})")
    if data["format"] != TRACE_FORMAT:
        raise ValueError(f"{path}: format must be {TRACE_FORMAT!r}, got {reprlib.repr(data['format'])}")
    rows = data["requests"]
    if not isinstance(rows, list):
        raise ValueError(f"{path}: 'requests' must be a list of request objects, got a {type(rows).__name__}")
    if not rows:
        raise ValueError(f"{path}: 'requests' is empty; a trace needs >= 1 request")
    out, seen = [], {}
    for i, row in enumerate(rows):
        try:
            _check_trace_request(row)
            if row["request_id"] in seen:
                raise ValueError(f"request_id {row['request_id']!r} repeats request {seen[row['request_id']]}'s "
                                 "(ids must be unique)")
            seen[row["request_id"]] = i
            try:
                sampling = SamplingParams(**row.get("sampling", {}))
            except (TypeError, ValueError) as e:
                raise ValueError(f"sampling.{e}") from None
            try:
                r = Request(row["request_id"], row["prompt_token_ids"], max_new_tokens=row["max_new_tokens"],
                            sampling=sampling,
                            arrival_time_s=row.get("arrival_time_s", 0.0),
                            prompt_text=row.get("prompt_text"), priority=row.get("priority", 0))
            except (TypeError, ValueError) as e:  # Request's own message, less its "request 'id': " prefix
                raise ValueError(str(e).removeprefix(f"request {row['request_id']!r}: ")) from None
            if vocab_size is not None:
                check_in_vocab(r.prompt_token_ids, vocab_size)
            out.append(r)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: request {i}: {e}") from None
    return out
