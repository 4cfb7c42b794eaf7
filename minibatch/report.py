"""What a run leaves behind: the table printed, the figures, the JSON and its environment."""

from __future__ import annotations

from pathlib import Path

import torch


def write_json(result: dict, path: str | Path | None) -> None:
    """Write a benchmark result as indented, strict JSON (NaN/inf -> null: "metric undefined"),
    atomically (parent folders made; a failed write keeps the old file); nothing if path is None.
    See :mod:`minibatch.files`."""
    from minibatch.files import write_json as write_json_file

    if path:
        write_json_file(path, result, indent=2)
        print(f"wrote {path}")


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else platform.processor(), else "unknown"."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    """Versions and machine, stored with every result so numbers can be compared honestly."""
    import os
    import platform

    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "machine": platform.machine(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads()}
    if hasattr(os, "getloadavg"):  # other processes on the machine slow every step: record how busy it was
        env["load_average_1m"] = round(os.getloadavg()[0], 2)
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


# columns of compare's table after the registered metric columns (minibatch.metrics.COLUMNS with a header)
RUN_COLUMNS = (("kv_waste_fraction", "KV waste", "{:.1%}"), ("max_num_running", "max running", "{}"),
               ("num_preemptions", "preempted", "{}"), ("matches_reference", "matches ref", "{}"),
               ("clock", "clock", "{}"))


def print_table(result: dict) -> None:
    """compare's and simulate's table: a row per policy, then each policy against the one it improves on
    (``PolicySpec.improves_on``) where both ran: output throughput and ITL p99 ratios."""
    from minibatch.metrics import COLUMNS
    from minibatch.policies import POLICIES

    cols = [(name, c.header, c.fmt) for name, c in COLUMNS.items() if c.header] + list(RUN_COLUMNS)
    header = f"{'policy':<18}" + "".join(f"{c[1]:>13}" for c in cols)
    print(header)
    print("-" * len(header))
    for name, entry in result["policies"].items():
        cells = [fmt.format(entry.get(key)) if entry.get(key) is not None else "-" for key, _, fmt in cols]
        print(f"{name:<18}" + "".join(f"{c:>13}" for c in cells))
    p = result["policies"]
    for a, entry in p.items():
        b = POLICIES[a].improves_on if a in POLICIES else None
        if b not in p:
            continue
        line = f"{a} / {b} output throughput: {entry['output_throughput_tok_s'] / p[b]['output_throughput_tok_s']:.2f}x"
        if entry.get("itl_p99_s") and p[b].get("itl_p99_s"):
            line += f", ITL p99: {entry['itl_p99_s'] / p[b]['itl_p99_s']:.2f}x"
        if "spec_decoding" in entry:
            st = entry["spec_decoding"]
            line += (f" (acceptance rate {st['acceptance_rate']:.1%}, mean acceptance length "
                     f"{st['mean_acceptance_length']:.2f})")
        print(line)


def save_figures(runs: dict, figures_dir: str) -> list[str]:
    """Gantt charts of our engines' schedules, KV block maps of the paged ones, latency CDFs and
    throughput/latency bars. runs: policy -> :class:`~minibatch.experiment.Run`."""
    import matplotlib.pyplot as plt

    from minibatch.viz import compare_gantt, kv_block_map, latency_cdf, save, throughput_latency_bars

    paths = []
    engines = {name: run.records for name, run in runs.items() if run.engine is not None}
    if engines:
        fig = compare_gantt(engines, rows="row", x="time")
        paths.append(save(fig, "compare_gantt", figures_dir))
        plt.close(fig)
    paged = {name: run.engine for name, run in runs.items() if run.engine is not None and run.engine.scheduler.pages_kv}
    if paged:
        fig, axes = plt.subplots(1, len(paged), figsize=(6 * len(paged), 4), layout="constrained", squeeze=False)
        for ax, (name, eng) in zip(axes[0], paged.items()):
            kv_block_map(eng.trace, eng.scheduler.kv_geometry()[0], ax=ax, title=f"{name}: KV blocks per step")
        paths.append(save(fig, "compare_kv_block_map", figures_dir))
        plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4), layout="constrained")
    for ax, metric in zip(axes, ("ttft", "itl", "e2e")):
        latency_cdf({n: run.requests for n, run in runs.items()}, metric=metric, ax=ax)
    paths.append(save(fig, "compare_latency_cdf", figures_dir))
    plt.close(fig)
    ax_tput, _ = throughput_latency_bars({n: run.summary for n, run in runs.items()})
    paths.append(save(ax_tput.figure, "compare_throughput_latency", figures_dir))
    plt.close(ax_tput.figure)
    return [str(p) for p in paths]
