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
* Percentiles use ``numpy.percentile`` (linear interpolation), like vLLM.

Trace metrics read the list of :class:`~minibatch.engine.StepRecord` (the schedule trace).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from minibatch.engine import StepRecord
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


def request_metrics(requests: list[Request]) -> list[RequestMetrics]:
    """Per-request TTFT, TPOT, ITL, E2E and queueing delay, in the order given.

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
        ttft_s = r.token_times_s[0] - r.arrival_time_s
        e2e_s = r.finish_time_s - r.arrival_time_s
        n = r.num_output_tokens
        queueing_s = None if r.first_scheduled_time_s is None else r.first_scheduled_time_s - r.arrival_time_s
        out.append(RequestMetrics(
            request_id=r.request_id,
            ttft_s=ttft_s,
            tpot_s=(e2e_s - ttft_s) / (n - 1) if n > 1 else None,
            e2e_s=e2e_s,
            itl_s=[b - a for a, b in zip(r.token_times_s, r.token_times_s[1:])],
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=n,
            queueing_delay_s=queueing_s,
        ))
    return out


@dataclass
class BenchmarkSummary:
    """What ``benchmark_serving`` prints, plus schedule-trace numbers. Times in seconds.

    Latency statistics of an empty sample (e.g. TPOT when every output has 1 token) are None.
    goodput_req_s is None without an SLO; trace fields are None without a trace.
    """

    num_requests: int
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    request_throughput_req_s: float
    output_throughput_tok_s: float
    total_throughput_tok_s: float
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_mean_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    tpot_p99_s: float | None
    itl_mean_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    itl_p99_s: float | None
    e2e_mean_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    e2e_p99_s: float | None
    queueing_delay_mean_s: float | None
    slo: SLO | None = None
    num_good_requests: int | None = None
    goodput_req_s: float | None = None
    num_steps: int | None = None
    padding_waste_fraction: float | None = None
    slot_utilization: float | None = None
    mean_batch_size: float | None = None
    kv_waste_fraction: float | None = None
    max_num_running: int | None = None  # the most requests running at once (concurrency)
    num_preemptions: int | None = None

    def to_dict(self) -> dict:
        """A JSON-ready dict (plain floats; the SLO as a dict or None)."""
        return dataclasses.asdict(self)


def _stats(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of values (numpy linear interpolation); all None for no values."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(requests: list[Request], trace: list[StepRecord] | None = None,
              slo: SLO | None = None) -> BenchmarkSummary:
    """Benchmark summary of finished ``requests`` (and the schedule ``trace`` if given).

    duration_s runs from the first arrival to the last finish. vLLM divides by the benchmark's
    wall duration (first request sent to last response received), which is the same span when
    the benchmark starts sending at the first arrival. Throughputs and goodput are per second
    of duration_s.

    Raises:
        ValueError: no requests, an unfinished request (named), or a zero duration.
    """
    if not requests:
        raise ValueError("summarize needs at least one request")
    metrics = request_metrics(requests)
    duration_s = max(r.finish_time_s for r in requests) - min(r.arrival_time_s for r in requests)
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0 (first arrival to last finish), got {duration_s}")
    num_prompt = sum(m.num_prompt_tokens for m in metrics)
    num_output = sum(m.num_output_tokens for m in metrics)
    fields: dict = {}
    samples = {
        "ttft": [m.ttft_s for m in metrics],
        "tpot": [m.tpot_s for m in metrics if m.tpot_s is not None],
        "itl": [gap for m in metrics for gap in m.itl_s],
        "e2e": [m.e2e_s for m in metrics],
    }
    for name, values in samples.items():
        fields.update({f"{name}_{stat}_s": v for stat, v in _stats(values).items()})
    queueing = [m.queueing_delay_s for m in metrics if m.queueing_delay_s is not None]
    summary = BenchmarkSummary(
        num_requests=len(metrics),
        duration_s=duration_s,
        total_prompt_tokens=num_prompt,
        total_output_tokens=num_output,
        request_throughput_req_s=len(metrics) / duration_s,
        output_throughput_tok_s=num_output / duration_s,
        total_throughput_tok_s=(num_prompt + num_output) / duration_s,
        queueing_delay_mean_s=float(np.mean(queueing)) if queueing else None,
        **fields,
    )
    if slo is not None:
        summary.slo = slo
        summary.num_good_requests = sum(slo.is_met(m) for m in metrics)
        summary.goodput_req_s = summary.num_good_requests / duration_s
    if trace is not None:
        summary.num_steps = len(trace)
        summary.padding_waste_fraction = padding_waste_fraction(trace)
        summary.slot_utilization = slot_utilization(trace)
        summary.mean_batch_size = mean_batch_size(trace)
        summary.kv_waste_fraction = kv_waste_fraction(trace)
        summary.max_num_running = max((r.num_running for r in trace), default=0)
        summary.num_preemptions = sum(len(r.preempted) for r in trace)
    return summary


# ---------------------------------------------------------------------- the schedule trace
def _num_busy_rows(record: StepRecord) -> int:
    return sum(e.phase != "padding" for e in record.entries)


def padding_waste_fraction(trace: list[StepRecord]) -> float:
    """Padding tokens / every token computed (padding included): prompt left-padding plus the
    rows of finished requests in a static batch. 0.0 for an empty trace."""
    padding = sum(r.num_padding_tokens for r in trace)
    computed = sum(r.num_scheduled_tokens for r in trace) + padding
    return padding / computed if computed else 0.0


def slot_utilization(trace: list[StepRecord]) -> float:
    """Busy batch rows / (busy + padding + idle rows), summed over steps. Padding rows are
    static batching's early-finished waste; idle rows are slots no request fills."""
    busy = sum(_num_busy_rows(r) for r in trace)
    total = sum(len(r.entries) + r.num_idle_rows for r in trace)
    return busy / total if total else 0.0


def mean_batch_size(trace: list[StepRecord]) -> float:
    """Mean number of requests computing tokens per step (padding rows not counted)."""
    return float(np.mean([_num_busy_rows(r) for r in trace])) if trace else 0.0


def kv_waste_fraction(trace: list[StepRecord]) -> float:
    """1 - KV slots used / KV slots reserved, summed over steps: slots reserved but not (yet)
    written, e.g. Orca's prompt + max_new_tokens reservation. Static batching counts its padded
    (B, T) cache as used, so its padding shows in padding_waste_fraction instead."""
    reserved = sum(r.num_kv_slots_reserved for r in trace)
    return 1.0 - sum(r.num_kv_slots_used for r in trace) / reserved if reserved else 0.0


def utilization_formula(output_lens: list[int]) -> float:
    """The static batching formula: a batch runs max(output_len) generation steps and
    request i produces a token in output_len[i] of them, so utilization = avg_len / max_len."""
    if not output_lens or min(output_lens) < 1:
        raise ValueError(f"output_lens must be a non-empty list of lengths >= 1, got {output_lens}")
    return float(np.mean(output_lens)) / max(output_lens)


def measured_decode_utilization(trace: list[StepRecord]) -> float:
    """Batch rows that produced a token / (those + padding rows), over the whole trace.

    The step that finishes a prompt is the first *generation* step (it samples token 1), so a
    request's token-producing rows are its decode rows plus its last prefill row; that is why
    a single static batch measures exactly ``utilization_formula(output_lens)``. Idle slots
    are not counted (the formula is per formed batch); Orca has no padding rows, so 1.0.
    """
    entries = [e for record in trace for e in record.entries]
    num_padding = sum(e.phase == "padding" for e in entries)
    num_decode = sum(e.phase == "decode" for e in entries)
    # A prefill row produces a token unless the request's next row is another prefill chunk:
    # walk backwards, remembering each request's next phase.
    num_last_prefill, next_phase = 0, {}
    for e in reversed(entries):
        if e.phase == "prefill":
            num_last_prefill += next_phase.get(e.request_id) != "prefill"
        next_phase[e.request_id] = e.phase
    produced = num_decode + num_last_prefill
    return produced / (produced + num_padding) if produced + num_padding else 0.0
