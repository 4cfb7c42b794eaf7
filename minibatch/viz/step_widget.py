"""Step through a schedule: one engine step at a time, with a slider (ipywidgets).

For each step of a recorded trace (a real or a simulated run: ``engine.trace``) the view shows

* the batch composition: one bar per batch row, its tokens split into prefill (or a prefill
  chunk), decode, and draft tokens accepted / rejected (speculative decoding), padding hatched;
* the KV block map of that step: every physical block, coloured by the request whose
  block_table holds it (grey: shared by several, white: free);
* the queues: waiting and running requests, KV slots used, and who finished or was preempted.

:func:`step_figure` draws one step (a plain matplotlib figure, for scripts and nbval);
:func:`step_widget` wraps it in a slider and a play button.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from minibatch.viz.kv_map import SHARED_COLOR, natural_key, request_colors
from minibatch.viz.plots import HATCH, PALETTE, short_id

SEGMENTS = (("prefill", PALETTE["prefill"], None), ("chunk", PALETTE["chunk"], HATCH["chunk"]),
            ("decode", PALETTE["decode"], None), ("draft accepted", "#009E73", None),
            ("draft rejected", "#BBBBBB", "xx"), ("padding", PALETTE["padding"], HATCH["padding"]))


def _segments(e) -> dict[str, int]:
    """Tokens of one batch row by kind (see SEGMENTS)."""
    if e.phase == "padding":
        return {"padding": e.num_new_tokens}
    if e.phase == "prefill":
        return {"chunk" if e.is_chunk else "prefill": e.num_new_tokens}
    return {"decode": e.num_new_tokens - e.num_spec_tokens, "draft accepted": e.num_accepted_tokens,
            "draft rejected": e.num_spec_tokens - e.num_accepted_tokens}


def num_blocks_of(trace: list) -> int:
    """The number of KV blocks a trace's block tables address (largest block id + 1; 0: none)."""
    return 1 + max((b for rec in trace for t in rec.block_tables.values() for b in t), default=-1)


def step_figure(trace: list, step: int, num_blocks: int | None = None, fig=None):
    """Draw record ``step`` (an index into ``trace``) of a schedule trace; returns the figure.

    num_blocks: KV blocks in the cache (default: :func:`num_blocks_of`); 0 or a trace without
    block tables (static, orca) leaves the block map out.

    Raises:
        IndexError: step outside [0, len(trace)).
    """
    if not 0 <= step < len(trace):
        raise IndexError(f"step must be in [0, {len(trace)}), got {step}")
    rec = trace[step]
    num_blocks = num_blocks_of(trace) if num_blocks is None else num_blocks
    colors = request_colors({e.request_id for r in trace for e in r.entries})
    if fig is None:
        fig = plt.figure(figsize=(12, 3.6), layout="constrained")
    fig.clear()
    ax_batch, ax_kv, ax_q = fig.subplots(1, 3, width_ratios=[3, 2, 1.4])

    # 1. batch composition
    entries = sorted(rec.entries, key=lambda e: e.row)
    for y, e in enumerate(entries):
        x = 0
        for kind, color, hatch in SEGMENTS:
            n = _segments(e).get(kind, 0)
            if n:
                ax_batch.barh(y, n, left=x, color=color, hatch=hatch, edgecolor="white", linewidth=0.5)
                x += n
        ax_batch.text(x, y, f" {e.num_computed_tokens}+{e.num_new_tokens}", va="center", fontsize=8)
    ax_batch.set_yticks(range(len(entries)), [f"row {e.row}: {short_id(e.request_id)}" for e in entries], fontsize=8)
    for label, e in zip(ax_batch.get_yticklabels(), entries):  # a row label in its request's KV colour
        label.set_color(colors[e.request_id])
    ax_batch.margins(x=0.15)  # room for the labels right of the bars
    ax_batch.invert_yaxis()
    ax_batch.set_xlabel("tokens this step (label: num_computed_tokens + num_new_tokens)")
    ax_batch.set_title(f"step {rec.step}: {rec.start_s:.3f}-{rec.end_s:.3f} s, "
                       f"{rec.num_scheduled_tokens + rec.num_padding_tokens} tokens", fontsize=9)
    used = {k for e in rec.entries for k, n in _segments(e).items() if n}
    ax_batch.legend(handles=[Patch(facecolor=c, hatch=h, label=k, edgecolor="white")
                             for k, c, h in SEGMENTS if k in used],
                    fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)

    # 2. KV block map
    if num_blocks:
        width = int(np.ceil(np.sqrt(num_blocks)))
        img = np.ones((int(np.ceil(num_blocks / width)), width, 4))
        img.reshape(-1, 4)[num_blocks:] = (0.9, 0.9, 0.9, 0.0)  # past the last block: transparent
        owner: dict[int, str | None] = {}
        for rid, table in rec.block_tables.items():
            for b in set(table):
                owner[b] = None if b in owner else rid  # None: shared
        for b, rid in owner.items():
            img.reshape(-1, 4)[b] = plt.matplotlib.colors.to_rgba(SHARED_COLOR if rid is None else colors[rid])
        ax_kv.imshow(img, interpolation="nearest", aspect="auto")
        ax_kv.set_xticks(np.arange(-0.5, width, 1), minor=True)
        ax_kv.set_yticks(np.arange(-0.5, img.shape[0], 1), minor=True)
        ax_kv.grid(which="minor", color="white", linewidth=0.5)
        ax_kv.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
        ax_kv.set_title(f"KV blocks: {len(owner)} / {num_blocks} used (row-major, {width} per row)\n"
                        "colour: the request, as its row label", fontsize=9)
    else:
        ax_kv.axis("off")
        ax_kv.text(0.5, 0.5, f"no paged KV cache\n{rec.num_kv_slots_used} KV slots used\n"
                   f"{rec.num_kv_slots_reserved} reserved", ha="center", va="center", transform=ax_kv.transAxes)

    # 3. queues
    ax_q.bar(["waiting", "running"], [rec.num_waiting, rec.num_running], color=[PALETTE["waiting"], PALETTE["decode"]])
    ax_q.set_title("queues after the step", fontsize=9)
    notes = [f"{what}: {', '.join(short_id(r) for r in sorted(ids, key=natural_key))}"
             for what, ids in (("finished", rec.finished), ("preempted", rec.preempted)) if ids]
    if notes:
        ax_q.text(0.02, 0.98, "\n".join(notes), transform=ax_q.transAxes, va="top", fontsize=8, wrap=True)
    ax_q.set_ylim(0, max(1, max(r.num_waiting + r.num_running for r in trace)) * 1.3)
    return fig


def step_widget(trace: list, num_blocks: int | None = None, start: int = 0):
    """A slider (and play button) over the steps of ``trace``; each move redraws
    :func:`step_figure`. Returns an ipywidgets VBox (display it in a notebook).

    Raises:
        ValueError: an empty trace.
    """
    import ipywidgets as widgets
    from IPython.display import display

    if not trace:
        raise ValueError("trace is empty: run the engine first")
    slider = widgets.IntSlider(value=start, min=0, max=len(trace) - 1, description="step",
                               continuous_update=False, layout=widgets.Layout(width="60%"))
    play = widgets.Play(value=start, min=0, max=len(trace) - 1, interval=400)
    widgets.jslink((play, "value"), (slider, "value"))
    out = widgets.Output()

    def draw(change=None):
        with out:
            out.clear_output(wait=True)
            fig = step_figure(trace, slider.value, num_blocks)
            display(fig)
            plt.close(fig)

    slider.observe(draw, names="value")
    draw()
    box = widgets.VBox([widgets.HBox([play, slider]), out])
    box.draw = draw  # redraw the current step (tests, or after changing matplotlib settings)
    box.slider = slider
    return box
