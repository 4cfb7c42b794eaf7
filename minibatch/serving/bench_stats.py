"""The load generator's pure parts: option checks, arrival times, per-request latencies, the summary.

Definitions follow vLLM's serving benchmark (``calculate_metrics``), measured at the client:

* TTFT: first text chunk - send time. E2E: last text chunk - send time.
* ITL: the gap between successive text chunks (a chunk may carry several tokens; ITL is per chunk,
  as in vLLM), pooled over all requests for the summary.
* TPOT = (E2E - TTFT) / (output_tokens - 1), undefined (None) for output_tokens <= 1; such a request
  counts TPOT as 0 for goodput, as vLLM does. output_tokens is the server's ``usage.completion_tokens``
  when it sends usage, else the number of text chunks (``output_tokens_source`` says which).
* Percentiles are ``numpy.percentile`` (linear interpolation), like vLLM. All times are seconds.
* goodput: requests per second that met every SLO given (``minibatch.metrics.SLO``).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from minibatch.metrics import SLO, RequestMetrics

PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")
ENDPOINTS = ("completions", "chat")


def arrival_offsets(num_requests: int, rate: float = math.inf, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds after the start (the first at 0), as vLLM's ``get_request``.

    ``rate`` is the mean request rate (requests/s; inf = all at once, a burst). Gaps are gamma
    distributed with shape ``burstiness`` and mean 1/rate: burstiness 1 is a Poisson process,
    below 1 burstier, above 1 more even. Drawn from ``numpy.random.default_rng(seed)``.

    Raises:
        ValueError: rate or burstiness not > 0.
    """
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s (inf = all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness must be a finite number > 0 (1.0 = Poisson), got {burstiness}")
    if math.isinf(rate) or num_requests == 0:
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def check_options(num_prompts: int, rate: float, burstiness: float, max_concurrency: int | None, endpoint: str,
                  timeout_s: float) -> None:
    """Raise ValueError with a one-line message naming the first bad option and its allowed range."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    arrival_offsets(0, rate, burstiness)  # checks --rate and --burstiness
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1 (or omitted: unbounded), got {max_concurrency}")
    if endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"--timeout-s must be a finite number of seconds > 0, got {timeout_s}")


def check_args(args: argparse.Namespace) -> SLO | None:
    """Check every ``bench-serve`` option (ValueError naming the option); the SLO given, or None."""
    check_options(args.num_prompts, args.rate, args.burstiness, args.max_concurrency, args.endpoint, args.timeout_s)
    for option in ("max_prompt_len", "max_output_len", "output_len"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ValueError(f"--{option.replace('_', '-')} must be >= 1, got {value}")
    objectives = {name: getattr(args, f"slo_{name}") for name in ("ttft_s", "tpot_s", "e2e_s")}
    for name, value in objectives.items():
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"--slo-{name.replace('_', '-')} must be a finite number of seconds > 0, got {value}")
    return SLO(**objectives) if any(v is not None for v in objectives.values()) else None


def finish_record(record: dict) -> dict:
    """Add input/output token counts and TTFT/ITL/E2E/TPOT (seconds) to one request's record, computed
    from its ``send_time_s``, ``chunk_times_s`` and usage; returns it. input_tokens is the server's
    ``usage.prompt_tokens`` when sent, else the tokenized ``prompt_len``. A request without text chunks
    gets None for every latency and no ITL."""
    times, send = record["chunk_times_s"], record["send_time_s"]
    usage_prompt = record.get("prompt_tokens")
    record["input_tokens"] = usage_prompt if usage_prompt is not None else record["prompt_len"]
    usage_tokens = record.get("completion_tokens")
    record["output_tokens"] = usage_tokens if usage_tokens is not None else len(times)
    record["output_tokens_source"] = "usage" if usage_tokens is not None else "chunks"
    record["itl_s"] = [later - earlier for earlier, later in zip(times, times[1:])]
    if not times:
        record.update(ttft_s=None, e2e_s=None, tpot_s=None)
        return record
    record["ttft_s"], record["e2e_s"] = times[0] - send, times[-1] - send
    n = record["output_tokens"]
    record["tpot_s"] = (record["e2e_s"] - record["ttft_s"]) / (n - 1) if n > 1 else None
    return record


def latency_stats(name: str, values: list[float]) -> dict[str, float | None]:
    """``{name}_mean_s, _median_s, _p50_s, _p95_s, _p99_s`` of ``values`` (seconds); None when empty."""
    keys = ["mean", "median"] + [f"p{p}" for p in PERCENTILES]
    if not values:
        return {f"{name}_{k}_s": None for k in keys}
    a = np.asarray(values, dtype=float)
    stats = [a.mean(), np.median(a)] + [np.percentile(a, p) for p in PERCENTILES]
    return {f"{name}_{k}_s": float(v) for k, v in zip(keys, stats)}


def meets_slo(record: dict, slo: SLO) -> bool:
    """Whether a successful request met every objective of ``slo`` (a 1-token output counts TPOT as 0)."""
    m = RequestMetrics(request_id=str(record.get("index")), ttft_s=record["ttft_s"], tpot_s=record["tpot_s"],
                       e2e_s=record["e2e_s"], itl_s=record["itl_s"], num_prompt_tokens=record["input_tokens"],
                       num_output_tokens=record["output_tokens"])
    return slo.is_met(m)


def _per_second(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else math.nan  # nan is written as null: "undefined"


def summarize(records: list[dict], duration_s: float, slo: SLO | None = None) -> dict:
    """The run's summary from finished records (:func:`finish_record`) and its wall time (seconds).

    Throughputs are per second of ``duration_s``: request_throughput (req/s), output_throughput
    (output tok/s), total_token_throughput (prompt + output tok/s), goodput (req/s meeting ``slo``;
    None without one). Only successful requests enter the token counts, and only those that
    streamed text (``num_empty`` did not) the latencies and goodput.
    """
    done = [r for r in records if r["success"]]
    ok = [r for r in done if r["ttft_s"] is not None]
    total_in = sum(r["input_tokens"] for r in done)
    total_out = sum(r["output_tokens"] for r in done)
    num_good = sum(meets_slo(r, slo) for r in ok) if slo is not None else None
    summary = {
        "completed": len(done), "failed": len(records) - len(done), "num_empty": len(done) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": _per_second(len(done), duration_s),
        "output_throughput": _per_second(total_out, duration_s),
        "total_token_throughput": _per_second(total_in + total_out, duration_s),
        "num_good": num_good, "goodput": _per_second(num_good, duration_s) if slo is not None else None,
    }
    summary.update(latency_stats("ttft", [r["ttft_s"] for r in ok]))
    summary.update(latency_stats("tpot", [r["tpot_s"] for r in ok if r["tpot_s"] is not None]))
    summary.update(latency_stats("itl", [gap for r in ok for gap in r["itl_s"]]))
    summary.update(latency_stats("e2e", [r["e2e_s"] for r in ok]))
    return summary


def format_summary(summary: dict) -> str:
    """A short text table of the summary (throughputs, then latency percentiles in milliseconds)."""
    def fmt(value, scale=1.0, spec="{:.2f}"):
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else spec.format(value * scale)

    lines = [f"{'completed / failed':<28}{summary['completed']} / {summary['failed']}",
             f"{'duration (s)':<28}{fmt(summary['duration_s'])}",
             f"{'request throughput (req/s)':<28}{fmt(summary['request_throughput'])}",
             f"{'output throughput (tok/s)':<28}{fmt(summary['output_throughput'], spec='{:.1f}')}",
             f"{'total throughput (tok/s)':<28}{fmt(summary['total_token_throughput'], spec='{:.1f}')}"]
    if summary["goodput"] is not None:
        lines.append(f"{'goodput (req/s)':<28}{fmt(summary['goodput'])}  ({summary['num_good']} met the SLO)")
    lines.append(f"{'ms':<8}" + "".join(f"{k:>10}" for k in ("mean", "p50", "p95", "p99")))
    for name in LATENCIES:
        lines.append(f"{name.upper():<8}" + "".join(f"{fmt(summary[f'{name}_{k}_s'], 1e3, '{:.1f}'):>10}"
                                                   for k in ("mean", "p50", "p95", "p99")))
    return "\n".join(lines)
