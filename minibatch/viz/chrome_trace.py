"""Schedule traces as Chrome trace JSON, for Perfetto (ui.perfetto.dev) and chrome://tracing.

The Trace Event Format (the JSON object form, ``{"traceEvents": [...]}``): each event has a
phase ``ph``, a time ``ts`` in microseconds, a process ``pid`` and a thread ``tid``. We write:

* process 1, "batch rows": one track per batch row (the rows of the Gantt chart); every step
  puts a complete event (``"ph": "X"``, with ``dur``) on each row it uses, named after the
  request and what it did: ``prefill``, ``chunk`` (a partial prefill), ``decode``, ``verify``
  (speculative decoding: 1 + k tokens) or ``padding``.
* process 2, "requests": one track per request: a ``waiting`` span from arrival to its first
  step, then its steps; ``preempted`` and ``finished`` are instant events (``"ph": "i"``).
* process 3, "engine": counters (``"ph": "C"``) per step: tokens, batch rows, KV slots used,
  waiting and running requests.

Metadata events (``"ph": "M"``) name the processes and tracks. Times are the engine clock's, so a
simulated run opens the same way as a measured one.
"""

from __future__ import annotations

from pathlib import Path

from minibatch.files import write_json
from minibatch.request import Request

ROWS_PID, REQUESTS_PID, ENGINE_PID = 1, 2, 3


def _us(t_s: float) -> float:
    return round(t_s * 1e6, 3)


def _kind(entry) -> str:
    if entry.phase == "padding":
        return "padding"
    if entry.num_spec_tokens:
        return "verify"
    return "chunk" if entry.is_chunk else entry.phase


def chrome_trace(trace: list, requests: list[Request] | None = None, name: str = "minibatch") -> dict:
    """The Trace Event Format object of one run.

    trace: ``engine.trace`` (StepRecords). requests: the run's requests, for the waiting spans
    (arrival to first step); without them the request tracks hold only steps.
    name: shown in the process names (e.g. the policy).
    """
    events: list[dict] = []

    def meta(pid: int, tid: int | None, kind: str, value: str, sort: int | None = None):
        e = {"name": kind, "ph": "M", "pid": pid, "tid": tid or 0, "args": {"name": value}}
        events.append(e)
        if sort is not None:
            events.append({"name": kind.replace("_name", "_sort_index"), "ph": "M", "pid": pid, "tid": tid or 0,
                           "args": {"sort_index": sort}})

    meta(ROWS_PID, None, "process_name", f"{name}: batch rows", 1)
    meta(REQUESTS_PID, None, "process_name", f"{name}: requests", 2)
    meta(ENGINE_PID, None, "process_name", f"{name}: engine", 3)
    order = {r.request_id: i for i, r in enumerate(requests or [])}
    for rec in trace:  # requests not given: number them by first appearance
        for e in rec.entries:
            order.setdefault(e.request_id, len(order))
    rows = sorted({e.row for rec in trace for e in rec.entries})
    for s in rows:
        meta(ROWS_PID, s + 1, "thread_name", f"row {s}", s)
    for rid, i in order.items():
        meta(REQUESTS_PID, i + 1, "thread_name", rid, i)

    for r in requests or []:
        if r.first_scheduled_time_s is not None and r.first_scheduled_time_s > r.arrival_time_s:
            events.append({"name": "waiting", "cat": "queue", "ph": "X", "pid": REQUESTS_PID,
                           "tid": order[r.request_id] + 1, "ts": _us(r.arrival_time_s),
                           "dur": _us(r.first_scheduled_time_s - r.arrival_time_s)})
    for rec in trace:
        ts, dur = _us(rec.start_s), _us(rec.duration_s)
        for e in rec.entries:
            kind = _kind(e)
            args = {"step": rec.step, "num_new_tokens": e.num_new_tokens, "num_computed_tokens": e.num_computed_tokens}
            if e.num_spec_tokens:
                args.update(num_spec_tokens=e.num_spec_tokens, num_accepted_tokens=e.num_accepted_tokens)
            events.append({"name": f"{e.request_id} {kind}", "cat": kind, "ph": "X", "pid": ROWS_PID,
                           "tid": e.row + 1, "ts": ts, "dur": dur, "args": args})
            if kind != "padding":
                events.append({"name": kind, "cat": kind, "ph": "X", "pid": REQUESTS_PID,
                               "tid": order[e.request_id] + 1, "ts": ts, "dur": dur, "args": args})
        for rid, what in [(r, "preempted") for r in rec.preempted] + [(r, "finished") for r in rec.finished]:
            events.append({"name": what, "cat": what, "ph": "i", "s": "t", "pid": REQUESTS_PID,
                           "tid": order[rid] + 1, "ts": _us(rec.end_s)})
        counters = {"tokens": rec.num_scheduled_tokens + rec.num_padding_tokens, "rows": len(rec.entries),
                    "KV slots used": rec.num_kv_slots_used, "waiting": rec.num_waiting, "running": rec.num_running}
        for cname, value in counters.items():
            events.append({"name": cname, "ph": "C", "pid": ENGINE_PID, "tid": 0, "ts": ts, "args": {cname: value}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "minibatch", "name": name, "num_steps": len(trace)}}


def write_chrome_trace(path: str | Path, trace: list, requests: list[Request] | None = None,
                       name: str = "minibatch") -> Path:
    """Write :func:`chrome_trace` as compact strict JSON to ``path``, atomically (parent folders
    made; :func:`minibatch.files.write_json`); returns the path."""
    return write_json(path, chrome_trace(trace, requests, name), indent=None, separators=(",", ":"))
