"""Figures: the schedule Gantt chart and policy comparisons (``minibatch.viz.plots``), the KV
block map (``minibatch.viz.kv_map``)."""

from minibatch.viz.kv_map import block_map_array, kv_block_map, request_colors
from minibatch.viz.plots import (
    CELL_KINDS, PALETTE, Cell, compare_gantt, gantt, gantt_cells, latency_cdf, save, short_id,
    throughput_latency_bars,
)

__all__ = [
    "CELL_KINDS", "PALETTE", "Cell", "compare_gantt", "gantt", "gantt_cells", "latency_cdf", "save",
    "short_id", "throughput_latency_bars", "block_map_array", "kv_block_map", "request_colors",
]
