"""Latency and throughput from the events the engine stamps on requests (and the step trace).

Definitions follow vLLM's ``benchmarks/benchmark_serving.py`` (``calculate_metrics``):

    arrival        first token          second token   ...      last token = finish
       |----------------|-------------------|----- ... ----------|
       |<---- TTFT ---->|<------ ITL ------>|                    |
       |<------------------------------ E2E ------------------------------>|
                        TPOT = (E2E - TTFT) / (num_output_tokens - 1)

* TTFT: first token time - arrival_time_s. E2E latency: finish_time_s - arrival_time_s.
* TPOT: the mean gap after the first token; undefined for a 1-token output, so such requests
  are left out of the TPOT statistics (and count as TPOT 0 for goodput, as vLLM does).
* ITL: every gap between consecutive tokens of a request, pooled over all requests.
* queueing delay: first_scheduled_time_s - arrival_time_s.
* Percentiles (p50, p90, p99, vLLM's) use ``numpy.percentile`` (linear interpolation), like vLLM.

Every summary number is a registered :class:`Column` (:func:`register_column`): the engine's
summary (compare's and simulate's JSON and table) and bench-serve's client-side one compute the
same columns from the same per-request metrics, so a new metric is one ``register_column`` call.

Trace metrics read the list of :class:`~minibatch.engine.StepRecord` (the schedule trace); they
are defined in ``minibatch.records``, next to the records.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from minibatch.engine import StepRecord
from minibatch.records import (kv_waste_fraction, mean_batch_size, padding_waste_fraction,
                               slot_utilization)
from minibatch.request import Request

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestMetrics:
    """One finished request's latencies (seconds). tpot_s is None for a 1-token output."""

    request_id: str
    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    itl_s: list[float]
    num_prompt_tokens: int
    num_output_tokens: int
    queueing_delay_s: float | None = None  # None if the request has no first_scheduled stamp


@dataclass(frozen=True)
class SLO:
    """Service-level objectives (seconds); None = no objective on that metric.

    A request is *good* if it meets every objective given (value <= objective).

    Raises:
        ValueError: an objective that is not > 0 (the message names it).
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0 seconds (or None), got {value}")

    def is_met(self, m: RequestMetrics) -> bool:
        # vLLM: "if output_len <= 1, we regard tpot as 0 for goodput".
        tpot_s = m.tpot_s if m.tpot_s is not None else 0.0
        return all(
            objective is None or value <= objective
            for value, objective in ((m.ttft_s, self.ttft_s), (tpot_s, self.tpot_s), (m.e2e_s, self.e2e_s))
        )


def latencies(request_id: str, start_s: float, token_times_s: list[float], end_s: float, num_prompt_tokens: int,
              num_output_tokens: int, queueing_delay_s: float | None = None) -> RequestMetrics:
    """One request's metrics from its timestamps (seconds): TTFT = first token - start, E2E = end - start,
    TPOT = (E2E - TTFT) / (num_output_tokens - 1) (None for 1 token), ITL = successive token gaps. The
    engine stamps one time per token; a client (bench-serve) one per text chunk, which may carry several."""
    ttft_s, e2e_s, n = token_times_s[0] - start_s, end_s - start_s, num_output_tokens
    return RequestMetrics(request_id=request_id, ttft_s=ttft_s, tpot_s=(e2e_s - ttft_s) / (n - 1) if n > 1 else None,
                          e2e_s=e2e_s, itl_s=[b - a for a, b in zip(token_times_s, token_times_s[1:])],
                          num_prompt_tokens=num_prompt_tokens, num_output_tokens=n, queueing_delay_s=queueing_delay_s)


def request_metrics(requests: list[Request]) -> list[RequestMetrics]:
    """Per-request TTFT, TPOT, ITL, E2E and queueing delay (:func:`latencies`), in the order given.

    Raises:
        ValueError: a request is unfinished (no finish_time_s or no token times), or its token
            times do not match its output tokens. Requests are never silently dropped.
    """
    out = []
    for r in requests:
        if r.finish_time_s is None or not r.token_times_s:
            raise ValueError(f"request {r.request_id!r} is unfinished: no finish_time_s / token times")
        if len(r.token_times_s) != r.num_output_tokens:
            raise ValueError(
                f"request {r.request_id!r}: {len(r.token_times_s)} token times for "
                f"{r.num_output_tokens} output tokens (expected one time per token)"
            )
        queueing_s = None if r.first_scheduled_time_s is None else r.first_scheduled_time_s - r.arrival_time_s
        out.append(latencies(r.request_id, r.arrival_time_s, r.token_times_s, r.finish_time_s, r.num_prompt_tokens,
                             r.num_output_tokens, queueing_s))
    return out


@dataclass(frozen=True)
class Latency:
    """A per-request latency: ``values(m)`` its samples (seconds) from one request's RequestMetrics."""

    name: str
    description: str
    values: Callable[[RequestMetrics], list[float]]


LATENCIES = {lat.name: lat for lat in (
    Latency("ttft", "TTFT: arrival to first token", lambda m: [m.ttft_s]),
    Latency("tpot", "TPOT: mean gap after the first token, per request (none for a 1-token output)",
            lambda m: [] if m.tpot_s is None else [m.tpot_s]),
    Latency("itl", "ITL: gap between a request's successive tokens", lambda m: m.itl_s),
    Latency("e2e", "E2E: arrival to the last token", lambda m: [m.e2e_s]),
)}


@dataclass
class Sample:
    """What a summary column is computed from: finished requests' metrics, the run's duration (s), the SLO."""

    metrics: list[RequestMetrics]
    duration_s: float
    slo: SLO | None = None

    def latency(self, name: str) -> list[float]:
        """Every sample of the latency ``name`` (ITL pooled over requests)."""
        return [v for m in self.metrics for v in LATENCIES[name].values(m)]

    def per_second(self, count: float | None) -> float | None:
        return None if count is None else count / self.duration_s if self.duration_s > 0 else math.nan


@dataclass(frozen=True)
class Column:
    """A summary metric: the JSON key ``name``, its ``unit``, ``fn(sample)`` -> value (None: undefined),
    and, for the printed tables (compare's, bench-serve's), a ``header`` and a format ``fmt``."""

    name: str
    unit: str
    fn: Callable[[Sample], float | int | None]
    fmt: str = "{:.3f}"
    header: str | None = None  # None: in the JSON only


COLUMNS: dict[str, Column] = {}


def register_column(name: str, unit: str, fn: Callable[[Sample], float | int | None], fmt: str = "{:.3f}",
                    header: str | None = None) -> Column:
    """Add a summary metric (see :class:`Column`): it appears in every summary (the engine's runs in
    compare's and simulate's JSON, bench-serve's client-side summary) and, with a header, in their tables.

    Raises:
        ValueError: a name taken, or not lowercase letters, digits and "_".
    """
    if not re.fullmatch(r"[a-z][a-z0-9_]*", str(name)) or name in COLUMNS:
        raise ValueError(f"metric column name must be new, lowercase letters, digits and '_', got {name!r}")
    COLUMNS[name] = Column(name, unit, fn, fmt, header)
    return COLUMNS[name]


def _percentile(name: str, p: int | None) -> Callable[[Sample], float | None]:
    def fn(sample: Sample) -> float | None:
        values = sample.latency(name)
        if not values:
            return None
        return float(np.mean(values)) if p is None else float(np.percentile(np.asarray(values, dtype=float), p))
    return fn


def _num_good(sample: Sample) -> int | None:
    return None if sample.slo is None else sum(sample.slo.is_met(m) for m in sample.metrics)


def _register_builtin_columns() -> None:
    def tokens(field):
        return lambda s: sum(getattr(m, field) for m in s.metrics)
    register_column("num_requests", "", lambda s: len(s.metrics), "{}")
    register_column("duration_s", "s", lambda s: s.duration_s)
    register_column("total_prompt_tokens", "tokens", tokens("num_prompt_tokens"), "{}")
    register_column("total_output_tokens", "tokens", tokens("num_output_tokens"), "{}")
    register_column("request_throughput_req_s", "req/s", lambda s: s.per_second(len(s.metrics)))
    register_column("output_throughput_tok_s", "tok/s", lambda s: s.per_second(tokens("num_output_tokens")(s)),
                    "{:.1f}", "out tok/s")
    register_column("total_throughput_tok_s", "tok/s", lambda s: s.per_second(
        tokens("num_prompt_tokens")(s) + tokens("num_output_tokens")(s)), "{:.1f}", "total tok/s")
    shown = {"ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_s", "e2e_p50_s"}
    for name in LATENCIES:
        for stat, p in [("mean", None)] + [(f"p{q}", q) for q in PERCENTILES]:
            key = f"{name}_{stat}_s"
            register_column(key, "s", _percentile(name, p), "{:.4f}" if name == "tpot" else "{:.3f}",
                            f"{name.upper()} {stat} s" if key in shown else None)
    register_column("queueing_delay_mean_s", "s", lambda s: float(np.mean(q)) if (q := [
        m.queueing_delay_s for m in s.metrics if m.queueing_delay_s is not None]) else None)
    register_column("num_good_requests", "", _num_good, "{}")
    register_column("goodput_req_s", "req/s", lambda s: s.per_second(_num_good(s)), "{:.3f}", "goodput r/s")


_register_builtin_columns()


def summary_values(sample: Sample) -> dict:
    """Every registered column's value for ``sample``, in registration order."""
    return {name: column.fn(sample) for name, column in COLUMNS.items()}


def format_cell(name: str, value) -> str:
    """A column's value as its table shows it ("-" when undefined)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return COLUMNS[name].fmt.format(value) if name in COLUMNS else str(value)


class BenchmarkSummary:
    """What ``benchmark_serving`` prints, plus schedule-trace numbers: every registered column
    (:data:`COLUMNS`) as an attribute (``summary.ttft_p90_s``), then the trace fields (None without a
    trace): num_steps, padding_waste_fraction, slot_utilization, mean_batch_size, kv_waste_fraction,
    max_num_running (the most requests running during one step), num_preemptions; and num_aborted (requests
    aborted, left out of the latency and throughput columns; the trace fields count every step). Times in
    seconds; latency statistics of an empty sample are None; goodput_req_s is None without an SLO."""

    TRACE_FIELDS = ("num_steps", "padding_waste_fraction", "slot_utilization", "mean_batch_size",
                    "kv_waste_fraction", "max_num_running", "num_preemptions")

    def __init__(self, values: dict, slo: SLO | None = None):
        self.values, self.slo = values, slo

    def __getattr__(self, name: str):
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"BenchmarkSummary has no {name!r}; its fields are {', '.join(values)}")

    def to_dict(self) -> dict:
        """A JSON-ready dict (plain numbers; the SLO as a dict or None)."""
        slo = None if self.slo is None else dataclasses.asdict(self.slo)
        return {k: v for k, v in self.values.items() if k not in self.TRACE_FIELDS} | {"slo": slo} | {
            k: self.values[k] for k in self.TRACE_FIELDS}


def summarize(requests: list[Request], trace: list[StepRecord] | None = None,
              slo: SLO | None = None) -> BenchmarkSummary:
    """Benchmark summary of finished ``requests`` (and the schedule ``trace`` if given).

    duration_s runs from the first arrival to the last finish. vLLM divides by the benchmark's
    wall duration (first request sent to last response received), which is the same span when
    the benchmark starts sending at the first arrival. Throughputs and goodput are per second
    of duration_s. Aborted requests (finish_reason "abort": ``Engine.abort_request``) are left out of the
    latency and throughput columns and counted in ``num_aborted``, as vLLM's benchmark counts failed requests apart
    (the trace fields, from ``trace``, still count every step).

    Raises:
        ValueError: no requests, an unfinished request (named), every request aborted, or a zero duration.
    """
    if not requests:
        raise ValueError("summarize needs at least one request")
    done = [r for r in requests if r.finish_reason != "abort"]
    if not done:
        raise ValueError(f"all {len(requests)} requests were aborted: no latency or throughput to summarize")
    num_aborted, requests = len(requests) - len(done), done
    metrics = request_metrics(requests)
    duration_s = max(r.finish_time_s for r in requests) - min(r.arrival_time_s for r in requests)
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0 (first arrival to last finish), got {duration_s}")
    values = summary_values(Sample(metrics, duration_s, slo))
    traced = trace is not None
    values |= {
        "num_steps": len(trace) if traced else None,
        "padding_waste_fraction": padding_waste_fraction(trace) if traced else None,
        "slot_utilization": slot_utilization(trace) if traced else None,
        "mean_batch_size": mean_batch_size(trace) if traced else None,
        "kv_waste_fraction": kv_waste_fraction(trace) if traced else None,
        # running during a step: those still running after it and those it finished (a disaggregated prefill
        # replica's requests all leave with their prefill's step)
        "max_num_running": max((r.num_running + len(r.finished) for r in trace), default=0) if traced else None,
        "num_preemptions": sum(len(r.preempted) for r in trace) if traced else None,
    } | {"num_aborted": num_aborted}
    return BenchmarkSummary(values, slo)
