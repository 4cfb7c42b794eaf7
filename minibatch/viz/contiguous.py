"""The fragmentation demo's figure: the contiguous slot map and the paged block map, row by row."""

from __future__ import annotations

from minibatch.kv.contiguous import compaction_bytes

def plot_demo(steps: list, kv_bytes_per_token: int | None = None):  # steps: DemoStep rows
    """Left: the contiguous slot map, one row per demo row (top first), a colour per request,
    free slots white and hatched; refusals and compactions annotated. Right: the paged cache
    on the same slots, block boundaries drawn, each block's unused tail (internal
    fragmentation) in a paler shade. kv_bytes_per_token: if given, the compaction note also
    says how many bytes were copied. Returns the Figure (no plt.show())."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    from minibatch.viz.kv_map import request_colors

    ids = {r for s in steps for r in s.slot_map + s.block_map if r is not None}
    colors = request_colors(ids)
    num_slots = len(steps[0].slot_map)
    block_size = num_slots // len(steps[0].block_map)  # fragmentation_demo: same memory, whole blocks
    num_rows = len(steps)
    fig, (ax_c, ax_p) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.38 * num_rows), sharey=True,
                                     layout="constrained")
    free_style = dict(facecolor="white", edgecolor="#BBBBBB", hatch="///", linewidth=0)
    for row, s in enumerate(steps):
        for x0, width, rid in runs_of(s.slot_map):  # contiguous: one rectangle per region / hole
            style = free_style if rid is None else dict(facecolor=colors[rid], edgecolor="white", linewidth=0.5)
            ax_c.add_patch(Rectangle((x0, row + 0.1), width, 0.8, **style))
        for block_id, (rid, fill) in enumerate(zip(s.block_map, s.block_fill)):  # paged: block by block
            x0 = block_id * block_size
            if rid is None:
                ax_p.add_patch(Rectangle((x0, row + 0.1), block_size, 0.8, **free_style))
                continue
            ax_p.add_patch(Rectangle((x0, row + 0.1), fill, 0.8, facecolor=colors[rid], linewidth=0))
            if fill < block_size:  # reserved but unused: internal fragmentation
                ax_p.add_patch(Rectangle((x0 + fill, row + 0.1), block_size - fill, 0.8,
                                         facecolor=colors[rid], alpha=0.3, linewidth=0))
        paged_note = f"{s.event.request_id} refused" if s.paged_refused else f"{s.internal_fragmentation_slots} unused"
        ax_p.text(1.01, row + 0.5, paged_note, transform=ax_p.get_yaxis_transform(), va="center",
                  fontsize=8, color="#B00000" if s.paged_refused else "#555555")
    for x in range(0, num_slots + 1, block_size):
        ax_p.axvline(x, color="#666666", linewidth=0.6)
    for ax, title in ((ax_c, "contiguous: one region per request (first fit)"),
                      (ax_p, f"paged: blocks of {block_size} slots, any block anywhere\n"
                             "(pale: reserved, unused; right: unused slots in all)")):
        ax.set_xlim(0, num_slots)
        ax.set_ylim(num_rows, 0)
        ax.set_xlabel("KV token slot")
        ax.set_title(title, loc="left", fontsize=10)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    ax_c.set_yticks([r + 0.5 for r in range(num_rows)], [row_label(s, kv_bytes_per_token) for s in steps],
                    fontsize=8)
    for tick, s in zip(ax_c.get_yticklabels(), steps):
        tick.set_color("#B00000" if s.refused else "black")
    ax_c.tick_params(axis="y", length=0)
    handles = [Patch(facecolor=color, label=rid) for rid, color in colors.items()]
    handles.append(Patch(**free_style, label="free"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    return fig


def row_label(s, kv_bytes_per_token: int | None) -> str:
    """A demo row's y label: the event, and the contiguous allocator's refusal or compaction."""
    if s.refused:
        return f"{s.event.label}: refused, {s.refused} ({s.num_free_slots} free, largest {s.largest_free_extent})"
    if s.event.kind == "compact":
        moved = f"compact: {s.num_slots_moved} slots moved"
        if kv_bytes_per_token:
            moved += f" = {compaction_bytes(s.num_slots_moved, kv_bytes_per_token) / 2**20:.2f} MiB"
        return moved
    return s.event.label


def runs_of(owners: list[str | None]) -> list[tuple[int, int, str | None]]:
    """(start, length, owner) of each run of equal owners."""
    runs: list[tuple[int, int, str | None]] = []
    for i, rid in enumerate(owners):
        if runs and runs[-1][2] == rid:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, rid)
        else:
            runs.append((i, 1, rid))
    return runs
