"""Request-level versus iteration-level scheduling of the same requests, for notebook 02.

Four requests (output lengths 4, 12, 6, 16) start together in 4 batch rows; req-4 (6 tokens) arrives at step 2.
Request-level (static) scheduling keeps the batch until its longest request is done: finished rows compute padding
and req-4 waits for the whole batch. Iteration-level scheduling (Orca) picks the batch again at every step: a
finished request leaves at once, and req-4 joins at the next step, in the row req-0 freed. Hand-set numbers; no
model, no engine.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from minibatch_course.concepts import cell_legend
from minibatch.viz.plots import HATCH, PALETTE

OUTPUT_LENS = (4, 12, 6, 16)  # req-0..req-3, all arriving at step 0
LATE_ARRIVAL, LATE_LEN = 2, 6  # req-4
NUM_ROWS = 4  # batch rows (max_num_seqs)


def request_level() -> list[list[str]]:
    """Per request, the kind of each step ("" = not in the batch): one batch, then req-4 alone."""
    end = max(OUTPUT_LENS)
    rows = [["prefill"] + ["decode" if s < n else "padding" for s in range(1, end)] for n in OUTPUT_LENS]
    late = [""] * LATE_ARRIVAL + ["waiting"] * (end - LATE_ARRIVAL) + ["prefill"] + ["decode"] * (LATE_LEN - 1)
    return rows + [late]


def iteration_level() -> list[list[str]]:
    """Per request, the kind of each step: a finished request leaves, req-4 takes the first freed row."""
    rows = [["prefill"] + ["decode"] * (n - 1) for n in OUTPUT_LENS]
    first_free = min(OUTPUT_LENS)  # the step after the shortest request's last token
    start = max(LATE_ARRIVAL, first_free)
    late = [""] * LATE_ARRIVAL + ["waiting"] * (start - LATE_ARRIVAL) + ["prefill"] + ["decode"] * (LATE_LEN - 1)
    return rows + [late]


def _panel(ax, kinds: list[list[str]], title: str, num_steps: int):
    for i, row in enumerate(kinds):
        for s, kind in enumerate(row):
            if kind:
                ax.add_patch(Rectangle((s + 0.05, i + 0.05), 0.9, 0.9, facecolor=PALETTE[kind], edgecolor="white",
                                       hatch=HATCH.get(kind), linewidth=0.5))
        ax.text(-0.3, i + 0.5, f"req-{i}", ha="right", va="center", fontsize=9)
    end = max(len(row) for row in kinds)
    ax.axvline(end, color="black", linewidth=1, linestyle="--")
    ax.text(end + 0.15, len(kinds) - 0.5, f"all done\nafter {end} steps", ha="left", va="center", fontsize=9)
    ax.set_xlim(-2.0, num_steps + 3.2)
    ax.set_ylim(len(kinds) + 0.2, -0.2)
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, loc="left", fontsize=10)


def draw():
    """The figure: request-level scheduling (top) and iteration-level scheduling (bottom), one step axis."""
    static, orca = request_level(), iteration_level()
    num_steps = max(len(row) for row in static)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 5.6), sharex=True, layout="constrained")
    _panel(top, static, "request-level (static): the batch is fixed until its longest request finishes",
           num_steps)
    _panel(bottom, orca, "iteration-level (Orca): the batch is picked again at every step", num_steps)
    top.annotate("finished requests keep\ntheir rows: padding", xy=(15.5, 1.5), xytext=(17, 1.5), ha="left",
                 va="center", fontsize=9, arrowprops=dict(arrowstyle="-|>", color="black", linewidth=0.8))
    top.text(9, 4.5, "req-4 waits for the whole batch", ha="center", va="center", fontsize=9)
    leave = OUTPUT_LENS[0]
    bottom.annotate("req-0 leaves at once", xy=(leave, 0.5), xytext=(leave + 3.5, 0.5), ha="left", va="center",
                    fontsize=9, arrowprops=dict(arrowstyle="-|>", color="black", linewidth=0.8))
    join = orca[-1].index("prefill")
    bottom.annotate(f"req-4 joins at the next step ({join}),\ntaking the batch row req-0 freed", xy=(join + 0.7, 4.2),
                    xytext=(join + 2.6, 2.5), ha="left", va="center", fontsize=9,
                    arrowprops=dict(arrowstyle="-|>", color="black", linewidth=0.8))
    bottom.set_xticks([s + 0.5 for s in range(0, num_steps, 3)], [str(s) for s in range(0, num_steps, 3)],
                      fontsize=8)
    bottom.set_xlabel(f"step ({NUM_ROWS} batch rows in both)", fontsize=9)
    cell_legend(fig, {"prefill": "prefill", "decode": "decode (one token)", "padding": "padding (computed, no token)",
                      "waiting": "waiting (arrived, not in the batch)"})
    return fig
