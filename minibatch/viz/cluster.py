"""A cluster's replicas side by side: one Gantt chart (requests' prefill and decode steps on the time axis) and
KV cache strip per replica, on one time axis (``minibatch.viz.plots.compare_gantt``)."""

from __future__ import annotations

from minibatch.viz.plots import compare_gantt


def replica_gantt(run, width: float = 12.0, max_replicas: int | None = None):
    """``run``: a :class:`~minibatch.cluster.cluster.ClusterRun`. Each replica's schedule (batch rows over time)
    with its KV usage under it, titled with its index, role and the requests routed to it. Returns the Figure."""
    replicas = run.replicas[:max_replicas]
    traces = {f"replica {r.index} ({r.role}, {r.routed} requests)": r.engine.trace for r in replicas}
    return compare_gantt(traces, rows="row", x="time", width=width)
