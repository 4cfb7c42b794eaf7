"""The step profile's figure (``python -m minibatch profile --figure``, notebook 07b): each shape's components as
stacked shares of its step, with the step time and its distance from the roofline bound on top."""

from __future__ import annotations


def profile_figure(result: dict):
    """Stacked bars of each shape's components (share of the profiled step), its step time and its step time over
    the roofline bound written on top. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    rows = result["shapes"]
    labels = [f"{r['kind']}\n{r['batch'] if r['kind'] == 'decode' else r['tokens']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(rows)
    colors = plt.get_cmap("tab20").colors
    for i, comp in enumerate(rows[0]["components_s"]):  # the profile's component order
        shares = [r["components_s"][comp] / r["profiled_step_s"] for r in rows]
        ax.bar(labels, shares, bottom=bottom, label=comp, color=colors[i % len(colors)])
        bottom = [b + s for b, s in zip(bottom, shares)]
    for x, (r, top) in enumerate(zip(rows, bottom)):
        busy = f"\nGPU busy {r['device_busy_share']:.0%}" if "device_busy_share" in r else ""
        ax.text(x, top + 0.01, f"{r['step_s'] * 1e3:.0f} ms\n{r['step_over_bound']:.1f}x bound{busy}", ha="center",
                fontsize=8)
    on_gpu = "device_busy_share" in rows[0]  # on a GPU the components are host time: the CPU issuing each op
    ax.set_ylabel("share of the (profiled) step" + (", host time" if on_gpu else ""))
    ax.set_ylim(0, 1.3 if on_gpu else 1.25)
    ax.set_title(f"Where a step's time goes: {result['model']}, {result['dtype']}, {result['attention_backend']} "
                 f"attention, {result['threads']} threads")
    ax.legend(fontsize=7, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    return fig


def plot_profile(result: dict, path: str) -> str:
    """Save :func:`profile_figure` to ``path`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pathlib import Path

    from minibatch.viz.plots import save

    fig = profile_figure(result)
    saved = save(fig, Path(path).name, Path(path).parent)
    plt.close(fig)
    return str(saved)
