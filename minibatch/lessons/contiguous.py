"""Notebook 04's contrast lesson: the fragmentation demo (``minibatch.experiments.fragmentation``)
printed row by row (:func:`print_demo`) and drawn (``minibatch.viz.contiguous.plot_demo``).

vLLM (Kwon et al., SOSP'23, §3.1): reservation, internal and external fragmentation.
"""

from __future__ import annotations

from minibatch.experiments.fragmentation import DemoStep
from minibatch.kv.contiguous import (FREE_LABEL, LABELS)


def print_demo(steps: list[DemoStep]) -> None:
    """One line per demo row: event, contiguous slot map (render()-style), free extents,
    refusal or slots moved; then the paged block map (one character per block) and its
    internal fragmentation."""
    ids = list(dict.fromkeys(r for s in steps for r in s.slot_map + s.block_map if r is not None))
    # one character per request: its id if every id is one character, else A, B, C, ... in order
    labels = {r: r if all(len(i) == 1 for i in ids) else LABELS[k % len(LABELS)] for k, r in enumerate(ids)}
    show = lambda owners: "".join(FREE_LABEL if r is None else labels[r] for r in owners)  # noqa: E731
    width = len(steps[0].slot_map) if steps else 0
    print(f"{'event':<14} {'contiguous slots':<{width}}  {'free extents (start, len)':<26}{'':<24}  paged blocks")
    for s in steps:
        note = (f"REFUSED: {s.refused}" if s.refused else
                f"moved {s.num_slots_moved} slots" if s.event.kind == "compact" else "")
        extents = " ".join(f"({a},{n})" for a, n in s.free_extents)
        paged = f"{show(s.block_map)}  {'REFUSED, ' if s.paged_refused else ''}" \
                f"unused {s.internal_fragmentation_slots}"
        print(f"{s.event.label:<14} {show(s.slot_map)}  {extents:<26}{note:<24}  {paged}")
