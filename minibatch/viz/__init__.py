"""Figures: the schedule Gantt chart and policy comparisons (``minibatch.viz.plots``)."""

from minibatch.viz.plots import (
    CELL_KINDS, PALETTE, Cell, compare_gantt, gantt, gantt_cells, latency_cdf, save, short_id,
    throughput_latency_bars,
)

__all__ = [
    "CELL_KINDS", "PALETTE", "Cell", "compare_gantt", "gantt", "gantt_cells", "latency_cdf", "save",
    "short_id", "throughput_latency_bars",
]
