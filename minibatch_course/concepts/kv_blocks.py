"""Notebook 04's picture: a paged KV cache maps each request's logical blocks to physical blocks.

Two requests share a 4-token prefix (the same system prompt). Each request's KV is cut into logical blocks of
``block_size`` = 4 token slots; its ``block_table`` says which physical block of the one shared cache holds each
logical block, anywhere in the cache. The last block of a request is only partly filled (at most block_size - 1
empty slots: the only waste), and the prefix block is stored once, referenced by both tables (``ref_cnt`` 2).
Hand-set numbers; nothing is run.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from minibatch.viz.plots import PALETTE

BLOCK_SIZE = 4
NUM_BLOCKS = 8
SHARED = 1  # the physical block holding the shared prefix
# request -> (number of tokens, block_table, colour); the first logical block of both is the shared prefix
REQUESTS = {"A": (10, [SHARED, 6, 3], "#0072B2"), "B": (7, [SHARED, 4], "#009E73")}
SHARED_COLOR, EMPTY_EDGE = "#CC79A7", "#999999"
SLOT, GAP = 0.6, 0.25  # slot width and the gap between blocks, in data units


def _block(ax, x, y, labels, colors):
    """One block of BLOCK_SIZE slots at (x, y): slot i labelled labels[i] and filled colors[i] (None: empty)."""
    for i in range(BLOCK_SIZE):
        color = colors[i] if i < len(colors) else None
        ax.add_patch(Rectangle((x + i * SLOT, y), SLOT, SLOT, facecolor=color or "white",
                               edgecolor="white" if color else EMPTY_EDGE, linestyle="-" if color else "--",
                               linewidth=1))
        if i < len(labels):
            ax.text(x + (i + 0.5) * SLOT, y + SLOT / 2, labels[i], ha="center", va="center", fontsize=8,
                    color="white")
    ax.add_patch(Rectangle((x, y), BLOCK_SIZE * SLOT, SLOT, fill=False, edgecolor="black", linewidth=1.2))


def _owner(block):
    """(request, logical block index) pairs whose block_table points at physical ``block``."""
    return [(name, j) for name, (_, table, _) in REQUESTS.items() for j, b in enumerate(table) if b == block]


def _slot_contents(name, logical):
    """Labels and colours of the filled slots of ``name``'s logical block ``logical``."""
    num_tokens, table, color = REQUESTS[name]
    positions = range(logical * BLOCK_SIZE, min(num_tokens, (logical + 1) * BLOCK_SIZE))
    fill = SHARED_COLOR if table[logical] == SHARED else color
    return [str(p) for p in positions], [fill] * len(positions)


def draw() -> plt.Figure:
    fig, ax = plt.subplots(figsize=(11, 4.6), layout="constrained")
    width = BLOCK_SIZE * SLOT
    logical_y, physical_y = 3.2, 0.0
    tops = {}  # (request, logical block) -> the point arrows start from
    x = 0.0
    for name, (num_tokens, table, color) in REQUESTS.items():
        ax.text(x, logical_y + SLOT + 0.55, f"request {name}, {num_tokens} tokens: block_table = {table}",
                fontsize=9, color=color, fontweight="bold")
        for j in range(len(table)):
            labels, colors = _slot_contents(name, j)
            _block(ax, x, logical_y, labels, colors)
            ax.text(x + width / 2, logical_y + SLOT + 0.12, f"logical {j}", ha="center", fontsize=8)
            tops[(name, j)] = (x + width / 2, logical_y)
            x += width + GAP
        x += 1.2
    ax.text(0, physical_y - 1.1, f"one physical KV cache for all requests: {NUM_BLOCKS} blocks of "
            f"block_size = {BLOCK_SIZE} slots", fontsize=9, fontweight="bold")
    for b in range(NUM_BLOCKS):
        bx = b * (width + GAP)
        owners = _owner(b)
        if owners:
            labels, colors = _slot_contents(*owners[0])
            _block(ax, bx, physical_y, labels, colors)
        else:
            ax.add_patch(Rectangle((bx, physical_y), width, SLOT, facecolor=PALETTE["idle"], edgecolor="black",
                                   linewidth=1.2))
            ax.text(bx + width / 2, physical_y + SLOT / 2, "free", ha="center", va="center", fontsize=8)
        ax.text(bx + width / 2, physical_y - 0.3, f"block {b}", ha="center", fontsize=8)
        if len(owners) > 1:
            ax.text(bx + width / 2, physical_y - 0.65, f"ref_cnt {len(owners)}", ha="center", fontsize=8,
                    fontweight="bold", color=SHARED_COLOR)
        for owner in owners:
            x0, y0 = tops[owner]
            ax.add_patch(FancyArrowPatch((x0, y0 - 0.05), (bx + width / 2, physical_y + SLOT + 0.05),
                                         arrowstyle="-|>", mutation_scale=10, linewidth=1,
                                         color=REQUESTS[owner[0]][2]))
    ax.text(0, physical_y - 1.6, "slot = block_table[pos // block_size] * block_size + pos % block_size"
            "     e.g. A's position 9: block 3, slot 3 * 4 + 1 = 13", fontsize=9, family="monospace")
    handles = [Patch(facecolor=c, label=f"request {n}'s tokens") for n, (_, _, c) in REQUESTS.items()]
    handles += [Patch(facecolor=SHARED_COLOR, label="shared prefix block (ref_cnt 2)"),
                Patch(facecolor="white", edgecolor=EMPTY_EDGE, linestyle="--",
                      label="empty slot of a last block"),
                Patch(facecolor=PALETTE["idle"], edgecolor="black", label="free block")]
    ax.legend(handles=handles, loc="upper right", fontsize=8, frameon=False)
    ax.set_xlim(-0.2, NUM_BLOCKS * (width + GAP) + 0.1)
    ax.set_ylim(physical_y - 1.8, logical_y + SLOT + 1.0)
    ax.set_axis_off()
    return fig
