"""The load generator's pure parts: option checks, arrival times, per-request latencies, the summary.

The metrics are the engine's (``minibatch.metrics``: one set of definitions and columns, vLLM's
``calculate_metrics``), measured at the client:

* TTFT: first text chunk - send time. E2E: last text chunk - send time.
* ITL: the gap between successive text chunks (a chunk may carry several tokens; ITL is per chunk,
  as in vLLM), pooled over all requests for the summary.
* TPOT = (E2E - TTFT) / (output_tokens - 1), undefined (None) for output_tokens <= 1; such a request
  counts TPOT as 0 for goodput, as vLLM does. output_tokens is the server's ``usage.completion_tokens``
  when it sends a plausible one (an int from the number of text chunks to max_tokens), else the number of text
  chunks (``output_tokens_source`` says which; ``usage_error`` why a usage was not taken).
* A request succeeds when its stream ends with a finish_reason other than "abort" and holds at most max_tokens
  text chunks (:func:`stream_problem`): a stream cut short, or a request the server aborted (a drain), fails.
* Percentiles p50/p90/p99 are ``numpy.percentile`` (linear interpolation), like vLLM. All times are seconds.
* goodput: requests per second that met every SLO given (``minibatch.metrics.SLO``).
* client_lag_p99_s / client_lag_max_s: how late the client's own event loop ran (:func:`lag_summary`); over
  CLIENT_LAG_WARN_S the client was the bottleneck and its times are suspect (:func:`lag_warning`).
"""

from __future__ import annotations

import argparse
import math
from urllib.parse import urlsplit

import numpy as np

from minibatch.checks import (MAX_NUM_REQUESTS, MAX_NUM_SEQS, MAX_RATE, MAX_SECONDS, MAX_TOKENS, MIN_RATE, check_int,
                              check_real, short_repr)
from minibatch.metrics import (COLUMNS, LATENCIES, PERCENTILES, SLO, RequestMetrics, Sample, format_cell, latencies,
                               summary_values)

ENDPOINTS = ("completions", "chat")
MAX_BURSTINESS = 1000.0  # gamma shape: at 1000 the gaps are already nearly equal
DEFAULT_BURSTINESS, DEFAULT_MAX_OUTPUT_LEN = 1.0, 128  # the CLI's defaults (an option at another value was given)
LAG_TICK_S, CLIENT_LAG_WARN_S = 0.01, 0.05  # the client's event-loop probe, and the lag that makes its times suspect


def arrival_offsets(num_requests: int, rate: float = math.inf, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds after the start (the first at 0), as vLLM's ``get_request``.

    ``rate`` is the mean request rate (requests/s; inf = all at once, a burst). Gaps are gamma
    distributed with shape ``burstiness`` and mean 1/rate: burstiness 1 is a Poisson process,
    below 1 burstier, above 1 more even. Drawn from ``numpy.random.default_rng(seed)``.

    Raises:
        ValueError: rate not in [MIN_RATE, MAX_RATE] or inf, burstiness not in (0, MAX_BURSTINESS].
    """
    if not (MIN_RATE <= rate <= MAX_RATE or rate == math.inf):  # below MIN_RATE: gaps of days to eons
        raise ValueError(f"--rate must be in [{MIN_RATE:g}, {MAX_RATE:g}] requests/s or inf (all at once), "
                         f"got {rate}")
    check_real(burstiness, "--burstiness (1.0 = Poisson)", 0.0, MAX_BURSTINESS, low_open=True)
    if math.isinf(rate) or num_requests == 0:
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def check_options(num_prompts: int, rate: float, burstiness: float, max_concurrency: int | None, endpoint: str,
                  timeout_s: float, num_warmups: int = 0) -> None:
    """Raise ValueError with a one-line message naming the first bad option and its allowed range."""
    check_int(num_prompts, "--num-prompts", 1, MAX_NUM_REQUESTS)
    check_int(num_warmups, "--num-warmups", 0, MAX_NUM_REQUESTS)
    arrival_offsets(0, rate, burstiness)  # checks --rate and --burstiness
    if (num_prompts - 1) / rate > MAX_SECONDS:  # the sends alone would take longer than a week
        raise ValueError(f"--rate {rate:g}: {num_prompts} requests at {rate:g}/s take about "
                         f"{(num_prompts - 1) / rate:.3g} s to send, more than {MAX_SECONDS:g}; give at least "
                         f"{(num_prompts - 1) / MAX_SECONDS:.3g} requests/s")
    if rate == math.inf and burstiness != DEFAULT_BURSTINESS:
        raise ValueError(f"--burstiness {burstiness} does not apply with --rate inf (every request is sent at once); "
                         "give a finite --rate")
    if max_concurrency is not None:
        check_int(max_concurrency, "--max-concurrency (omit it: unbounded)", 1, MAX_NUM_SEQS)
    if endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    check_real(timeout_s, "--timeout-s (seconds)", 0.0, MAX_SECONDS, low_open=True)


def check_args(args: argparse.Namespace) -> SLO | None:
    """Check every ``bench-serve`` option (ValueError naming the option); the SLO given, or None."""
    check_options(args.num_prompts, args.rate, args.burstiness, args.max_concurrency, args.endpoint, args.timeout_s,
                  args.num_warmups)
    for option in ("max_prompt_len", "max_output_len", "output_len"):
        value = getattr(args, option)
        if value is not None:
            check_int(value, f"--{option.replace('_', '-')}", 1, MAX_TOKENS)
    if args.output_len is not None and args.max_output_len != DEFAULT_MAX_OUTPUT_LEN:
        raise ValueError(f"--max-output-len {args.max_output_len} does not apply with --output-len (every request "
                         "asks for exactly --output-len tokens)")
    check_int(args.seed, "--seed", 0, 2**63 - 1)
    objectives = {name: getattr(args, f"slo_{name}") for name in ("ttft_s", "tpot_s", "e2e_s")}
    for name, value in objectives.items():
        if value is not None:
            check_real(value, f"--slo-{name.replace('_', '-')} (seconds)", 0.0, MAX_SECONDS, low_open=True)
    url = urlsplit(args.base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"--base-url must be the server's http:// or https:// URL (e.g. http://127.0.0.1:8000), "
                         f"got {short_repr(args.base_url)}")
    omitted = {"model": "the server's first model", "tokenizer": "chosen by --model", "json": "no JSON"}
    for option, default in omitted.items():  # '' would silently mean the default
        if (value := getattr(args, option)) is not None and not value.strip():
            raise ValueError(f"--{option} must be non-empty (left out: {default}), got {value!r}")
    return SLO(**objectives) if any(v is not None for v in objectives.values()) else None


def api_base(base_url: str) -> str:
    """``base_url`` ending in ``/v1`` (given with or without it, trailing slashes ignored)."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def default_tokenizer_name(model: str) -> str:
    """The tokenizer to count tokens with: ``model`` if it is one of our model names, else smollm2-135m."""
    from minibatch.models import MODEL_NAMES

    return model if model in MODEL_NAMES else "smollm2-135m"


def chunk_text(chunk, endpoint: str) -> tuple[str, str | None]:
    """(the text a streamed chunk carries, its finish_reason): '' for role-only, empty and usage-only chunks.

    Raises:
        ValueError: the text is not a string (not an OpenAI stream)."""
    if not chunk.choices:
        return "", None
    choice = chunk.choices[0]
    text = (choice.delta.content if endpoint == "chat" else choice.text) or ""
    if not isinstance(text, str):
        raise ValueError(f"a chunk's text is not a string: {short_repr(text)}")
    return text, getattr(choice, "finish_reason", None)


def error_text(e: BaseException) -> str:
    """An exception as one record's error, with its cause (the openai client's "Connection error." hides why)."""
    cause = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {e}" + (f" ({type(cause).__name__}: {short_repr(str(cause))})" if cause else "")


def stream_problem(record: dict) -> str | None:
    """Why a stream that ended without an error is not a success, or None: no finish_reason (cut short, or not an
    OpenAI stream), finish_reason "abort" (the server gave up on it), or more text chunks than max_tokens."""
    n, reason = len(record["chunk_times_s"]), record.get("finish_reason")
    if not reason:
        return f"the stream ended without a finish_reason after {n} text chunks (cut short, or not an OpenAI stream)"
    if reason == "abort":
        return f"the server aborted it (finish_reason 'abort') after {n} text chunks"
    if n > record["output_len"]:
        return f"{n} text chunks for max_tokens {record['output_len']}"
    return None


def usage_count(value, low: int, high: int) -> int | None:
    """A usage count the server sent, if it is an int in [low, high], else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high else None


def finish_record(record: dict) -> dict:
    """Add input/output token counts and TTFT/ITL/E2E/TPOT (seconds, ``minibatch.metrics.latencies``) to one
    request's record, computed from its ``send_time_s``, ``chunk_times_s`` and usage; returns it. A success whose
    stream has a :func:`stream_problem` becomes a failure. input_tokens is the server's ``usage.prompt_tokens`` when
    it sent an int in [1, MAX_TOKENS], else the tokenized ``prompt_len``; output_tokens: see the module docstring.
    A request without text chunks gets None for every latency and no ITL."""
    times = record["chunk_times_s"]
    if record["success"] and (problem := stream_problem(record)):
        record.update(success=False, error=problem)
    sent = {k: record.get(k) for k in ("prompt_tokens", "completion_tokens")}
    prompt = usage_count(sent["prompt_tokens"], 1, MAX_TOKENS)
    record["input_tokens"] = prompt if prompt is not None else record["prompt_len"]
    output = usage_count(sent["completion_tokens"], len(times), max(len(times), record["output_len"]))
    record["output_tokens"] = output if output is not None else len(times)
    record["output_tokens_source"] = "usage" if output is not None else "chunks"
    taken = {"prompt_tokens": prompt, "completion_tokens": output}
    bad = [f"{k} {short_repr(v)}" for k, v in sent.items() if v is not None and taken[k] is None]
    if bad:
        record["usage_error"] = (f"usage {', '.join(bad)} not taken (not an int from the {len(times)} text chunks "
                                 f"to max_tokens {record['output_len']}, or a prompt of 1 to {MAX_TOKENS} tokens)")
    if not times:
        record.update(ttft_s=None, e2e_s=None, tpot_s=None, itl_s=[])
        return record
    m = request_metrics_of(record)
    record.update(ttft_s=m.ttft_s, e2e_s=m.e2e_s, tpot_s=m.tpot_s, itl_s=m.itl_s)
    return record


def request_metrics_of(record: dict) -> RequestMetrics:
    """A record's metrics (its start is the send time, its end the last chunk)."""
    times = record["chunk_times_s"]
    return latencies(str(record.get("index")), record["send_time_s"], times, times[-1], record["input_tokens"],
                     record["output_tokens"])


def summarize(records: list[dict], duration_s: float, slo: SLO | None = None) -> dict:
    """The run's summary from finished records (:func:`finish_record`) and its wall time (seconds).

    completed / failed / num_empty count requests; then every registered metric column
    (``minibatch.metrics.COLUMNS``: throughputs per second of ``duration_s``, latency mean/p50/p90/p99,
    goodput under ``slo``), computed from the successful requests that streamed text (``num_empty``
    did not), the same definitions as the engine's summary.
    """
    done = [r for r in records if r["success"]]
    ok = [r for r in done if r["chunk_times_s"]]
    summary = {"completed": len(done), "failed": len(records) - len(done), "num_empty": len(done) - len(ok),
               "num_usage_not_taken": sum("usage_error" in r for r in records)}
    return summary | summary_values(Sample([request_metrics_of(r) for r in ok], duration_s, slo))


def lag_summary(lags: list[float]) -> dict:
    """How late the client's event loop ran (seconds past each LAG_TICK_S sleep), p99 and max: a busy client (too
    many streams for its CPU) stamps chunks late, and its TTFT and ITL then include its own delay."""
    return {"client_lag_p99_s": float(np.percentile(lags, 99)) if lags else None,
            "client_lag_max_s": max(lags, default=None)}


def lag_warning(summary: dict) -> str | None:
    """A line saying the client was the bottleneck (its loop lagged over CLIENT_LAG_WARN_S), or None."""
    worst = summary.get("client_lag_max_s")
    if worst is None or worst <= CLIENT_LAG_WARN_S:
        return None
    return (f"the client's event loop ran up to {worst * 1e3:.0f} ms late (p99 {summary['client_lag_p99_s'] * 1e3:.0f}"
            " ms): chunks were stamped that late, so TTFT and ITL include the client's own delay; send fewer requests "
            "at once (--max-concurrency) or run the client on another machine")


def format_summary(summary: dict) -> str:
    """A short text table: the counts, every metric column with a header, then the latency
    statistics (:data:`~minibatch.metrics.LATENCIES`) in milliseconds."""
    lines = [f"{'completed / failed':<28}{summary['completed']} / {summary['failed']}"]
    lines += [f"{label:<28}{summary[key]}" for key, label in (("num_empty", "completed without text"),
                                                               ("num_usage_not_taken", "usage not taken (chunks)"))
              if summary.get(key)]
    lines.append(f"{'duration (s)':<28}{format_cell('duration_s', summary['duration_s'])}")
    stats = ["mean"] + [f"p{p}" for p in PERCENTILES]
    grid = {f"{name}_{k}_s" for name in LATENCIES for k in stats}  # shown below, in ms
    lines += [f"{c.header:<28}{format_cell(name, summary.get(name))}"
              for name, c in COLUMNS.items() if c.header and name not in grid]
    lines.append(f"{'ms':<8}" + "".join(f"{k:>10}" for k in stats))
    for name in LATENCIES:
        cells = [summary.get(f"{name}_{k}_s") for k in stats]
        lines.append(f"{name.upper():<8}" + "".join(f"{'-' if v is None else f'{v * 1e3:.1f}':>10}" for v in cells))
    return "\n".join(lines)
