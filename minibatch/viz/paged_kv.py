"""Figures for notebook 04 (paged KV): KV waste and concurrency over KV memory sizes, with vLLM's
reported ranges shaded, and the KV block map with the steps that preempted a request marked."""

from __future__ import annotations

import matplotlib.pyplot as plt

from minibatch.claims import claim
from minibatch.engine import StepRecord
from minibatch.viz.kv_map import kv_block_map

# The vLLM paper's KV figures (minibatch.claims "vllm-kv-used"): the fraction of the KV cache holding token
# states in the existing systems (its own Orca baselines of §6.1: "Oracle" reserves the true output length,
# "Pow2" up to 2x it, "Max" the model's maximum sequence length, 2048 tokens) and in vLLM, as waste fractions.
_USED = claim("vllm-kv-used").values
VLLM_CLAIM = {"existing_systems_waste": (1 - _USED["existing_systems_used"][1], 1 - _USED["existing_systems_used"][0]),
              "vllm_waste": 1 - _USED["vllm_used"], "claim_id": "vllm-kv-used"}


POLICY_STYLE = {"orca": ("#0072B2", "o", "orca (reserves the true length: oracle)"),
                "orca_max": ("#D55E00", "s", "orca, reserving {cap} new tokens"),
                "paged": ("#009E73", "^", "paged"), "paged_prefix": ("#CC79A7", "v", "paged + prefix caching")}


def plot_waste_sweep(sweep: list[dict], claim: dict = VLLM_CLAIM):
    """Two panels over n_slots: KV waste (%) with vLLM's reported ranges shaded, and the most
    requests running at once. Returns the Figure."""
    fig, (ax_w, ax_c) = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    lo, hi = claim["existing_systems_waste"]
    ax_w.axhspan(100 * lo, 100 * hi, color="#DDDDDD", zorder=0, label="vLLM paper: existing systems")
    ax_w.axhline(100 * claim["vllm_waste"], color="#777777", linestyle="--", linewidth=1, label="vLLM paper: vLLM")
    names = [p for p in POLICY_STYLE if any(p in row["policies"] for row in sweep)]
    for name in names:
        color, marker, label = POLICY_STYLE[name]
        label = label.format(cap=sweep[0].get("orca_max_new_tokens"))
        pts = [(row["n_slots"], row["policies"][name]) for row in sweep
               if "skipped" not in row["policies"].get(name, {"skipped": True})]
        xs = [x for x, _ in pts]
        ax_w.plot(xs, [100 * m["kv_waste_fraction"] for _, m in pts], marker=marker, color=color, label=label)
        ax_c.plot(xs, [m["max_num_running"] for _, m in pts], marker=marker, color=color, label=label)
    for ax, ylabel in ((ax_w, "KV waste, % of reserved slots"), (ax_c, "max requests running at once")):
        ax.set_xscale("log", base=2)
        ax.set_xticks([row["n_slots"] for row in sweep], [str(row["n_slots"]) for row in sweep])
        ax.minorticks_off()
        ax.set_xlabel("KV memory, n_slots (token slots)")
        ax.set_ylabel(ylabel)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    ax_w.set_ylim(0, 100)
    ax_w.legend(fontsize=7, frameon=False, loc="upper right", bbox_to_anchor=(1.0, 0.58))
    ax_c.set_ylim(bottom=0)
    return fig


def draw_block_map(trace: list[StepRecord], num_blocks: int, title: str | None = None):
    """:func:`minibatch.viz.kv_block_map` with a red line before each step whose schedule
    preempted a request (the victim holds no block from that step on), labelled with its id.
    Returns the Figure."""
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.22 * num_blocks), layout="constrained")
    kv_block_map(trace, num_blocks, ax=ax)
    if title:
        ax.set_title(title, loc="left", fontsize=10, pad=16)
    for record in trace:
        if record.preempted:
            ax.axvline(record.step, color="#B00000", linewidth=1.2)
            ax.text(record.step, -0.15, "preempt " + ",".join(record.preempted), color="#B00000", fontsize=8,
                    ha="center", va="bottom", clip_on=False)
    return fig
