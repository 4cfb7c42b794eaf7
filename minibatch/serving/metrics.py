"""Prometheus metrics of a running server, under vLLM's names with our prefix ``minibatch:``.

Gauges are set after every engine step (and after aborts) from the scheduler; counters and
histograms are fed from the step's :class:`~minibatch.engine.StepRecord` and from each finished
request's event stamps (TTFT, TPOT, ITL, E2E in seconds: ``minibatch.metrics.LATENCIES``, their
definitions and the histograms' documentation).
Each server has its own ``CollectorRegistry``, so several servers can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from minibatch.metrics import LATENCIES, latencies
from minibatch.request import Request

PREFIX = "minibatch:"
disable_created_metrics()  # no *_created series: one line per value, as vLLM shows them
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
HISTOGRAMS = {"ttft": ("time_to_first_token_seconds", LATENCY_BUCKETS_S),  # vLLM's names
              "tpot": ("time_per_output_token_seconds", ITL_BUCKETS_S),
              "itl": ("inter_token_latency_seconds", ITL_BUCKETS_S),
              "e2e": ("e2e_request_latency_seconds", LATENCY_BUCKETS_S)}


class ServingMetrics:
    """The server's metrics; ``on_step`` is the AsyncEngine's per-step hook, ``text()`` the
    /metrics body (Prometheus text format, ``CONTENT_TYPE_LATEST``)."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for admission (preempted ones included).")
        self.swapped = gauge("num_requests_swapped", "Requests preempted with their KV swapped to CPU memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache slots in use (reserved), 0..1.")
        self.preemptions = counter("num_preemptions", "Preemptions (recompute or swap).")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens computed (recomputed prompts included).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish_reason.",
                               ["model_name", "finished_reason"], registry=r)
        # one histogram per latency, documented by its definition in minibatch.metrics.LATENCIES
        self.latency = {name: histogram(prom_name, LATENCIES[name].description + ".", buckets)
                        for name, (prom_name, buckets) in HISTOGRAMS.items()}
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.", TOKEN_BUCKETS)
        self.model_name = model_name

    def on_step(self, engine, record=None, aborted=()) -> None:
        """Update from the engine after a step (``record``) or after aborts (``aborted`` requests)."""
        s = engine.scheduler
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting) + len(engine.pending))
        self.swapped.set(len(s.swapped))
        self.kv_usage.set(s.num_kv_slots_reserved / max(1, s.kv_capacity_slots(engine.executor.max_model_len)))
        for r in aborted:
            self.observe_finished(r)
        if record is None:
            return
        self.preemptions.inc(len(record.preempted))
        self.prompt_tokens.inc(record.num_prefill_tokens)
        self.generation_tokens.inc(sum(len(e.token_ids) for e in record.entries))
        self.iteration_tokens.observe(record.num_scheduled_tokens)
        for rid in record.finished:
            self.observe_finished(engine.requests[rid])

    def observe_finished(self, r: Request) -> None:
        """One finished request's latencies (aborted ones count only in request_success)."""
        self.success.labels(self.model_name, r.finish_reason or "unknown").inc()
        if r.finish_reason == "abort" or not r.token_times_s:
            return
        times = r.token_times_s
        m = latencies(r.request_id, r.arrival_time_s, times, times[-1], r.num_prompt_tokens, len(times))
        for name, histogram in self.latency.items():
            for value in LATENCIES[name].values(m):
                histogram.observe(value)

    def text(self) -> bytes:
        return generate_latest(self.registry)
