"""Figures: the schedule Gantt chart (``minibatch.viz.plots``), policy comparisons
(``minibatch.viz.results``), the KV
block map (``minibatch.viz.kv_map``), the step-through widget (``minibatch.viz.step_widget``) and
Chrome trace export for Perfetto (``minibatch.viz.chrome_trace``)."""

from minibatch.viz.chrome_trace import chrome_trace, write_chrome_trace
from minibatch.viz.kv_map import block_map_array, kv_block_map, request_colors
from minibatch.viz.plots import CELL_KINDS, PALETTE, Cell, compare_gantt, gantt, gantt_cells, save, short_id, show
from minibatch.viz.results import latency_cdf, throughput_latency_bars
from minibatch.viz.step_widget import step_figure, step_widget

__all__ = [
    "CELL_KINDS", "PALETTE", "Cell", "compare_gantt", "gantt", "gantt_cells", "latency_cdf", "save", "show",
    "short_id", "throughput_latency_bars", "block_map_array", "kv_block_map", "request_colors",
    "chrome_trace", "write_chrome_trace", "step_figure", "step_widget",
]
