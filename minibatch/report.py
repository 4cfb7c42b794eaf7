"""What a run leaves behind: the table printed, the figures, the JSON and its environment."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from minibatch.machine import cpu_id, cpu_isa, cpu_model, huge_pages_state, malloc_state


def write_json(result: dict, path: str | Path | None) -> None:
    """Write a benchmark result as indented, strict JSON (NaN/inf -> null: "metric undefined"),
    atomically (parent folders made; a failed write keeps the old file); nothing if path is None.
    See :mod:`minibatch.files`."""
    from minibatch.files import write_json as write_json_file

    if path:
        write_json_file(path, result, indent=2)
        print(f"wrote {path}")


ROOT = Path(__file__).resolve().parent.parent
# the code a step's time depends on: a profile calibrated before a change here prices the engine of then
ENGINE_PATHS = ("minibatch/runner", "minibatch/kernels", "minibatch/engine.py", "minibatch/scheduler", "minibatch/kv")


def _run_git(*args: str) -> str | None:
    import subprocess

    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def _is_checkout() -> bool:
    """Whether this package's folder is a git checkout's own (an installed copy inside another repo is not)."""
    top = _run_git("rev-parse", "--show-toplevel")
    return top is not None and Path(top).resolve() == ROOT


def _git(*args: str) -> str | None:
    """git's output in this package's checkout, or None (not a checkout's copy, no git, or git failed)."""
    return _run_git(*args) if _is_checkout() else None


def git_commit() -> str | None:
    """The commit of the checkout this package runs from (git's short hash, with "+changes" when tracked files
    differ from it), so a result names the code that made it; None where the package is not a git checkout's (an
    installed copy) or git is missing."""
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        return None
    return head + ("+changes" if _git("status", "--porcelain", "--untracked-files=no") else "")


def engine_changes_since(commit: str) -> list[str] | None:
    """The files of ENGINE_PATHS that differ between ``commit`` (as :func:`git_commit` names it) and this checkout;
    None where git cannot tell (no checkout, or the commit is not in its history)."""
    changed = _git("diff", "--name-only", commit.removesuffix("+changes"), "--", *ENGINE_PATHS)
    return None if changed is None else changed.splitlines()


def environment(load_before: dict | None = None) -> dict:
    """Versions, machine and commit (:func:`git_commit`), stored with every result so numbers can be compared
    honestly and traced to their code; with ``load_before`` (:func:`machine_load` at the start of the run) also
    ``load_before`` and ``load_after``. Reads transformers' version without importing it."""
    import os
    import platform
    from importlib.metadata import version

    from minibatch import __version__

    env = {"minibatch": __version__, "commit": git_commit(), "python": platform.python_version(),
           "torch": torch.__version__, "transformers": version("transformers"),
           "machine": platform.machine(), "cpu_model": cpu_model(), "cpu_id": cpu_id(), "cpu_isa": cpu_isa(),
           "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "malloc": malloc_state(),
           "kv_huge_pages": huge_pages_state()}
    if hasattr(os, "getloadavg"):  # other processes on the machine slow every step: record how busy it was
        env["load_average_1m"] = round(os.getloadavg()[0], 2)
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    if load_before is not None:
        env |= {"load_before": load_before, "load_after": machine_load()}
    return env


BUSY_CPU_PERCENT = 50.0  # another process using half a core or more competes with a timed run on a small machine


def machine_load(sample_s: float = 0.3) -> dict:
    """How busy the machine is now: the 1-minute load average, the CPU count, and the other processes
    (not this one or its children) that used >= BUSY_CPU_PERCENT of a core over ``sample_s`` seconds
    (pid, name, percent of one core), busiest first."""
    import os
    import time

    import psutil

    mine = {os.getpid()} | {c.pid for c in psutil.Process().children(recursive=True)}
    procs = [p for p in psutil.process_iter(["pid", "name"]) if p.pid not in mine]
    for p in procs:
        try:
            p.cpu_percent(None)  # starts the sample
        except psutil.Error:
            pass
    time.sleep(sample_s)
    busy = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
        except psutil.Error:
            continue
        if pct >= BUSY_CPU_PERCENT:
            busy.append({"pid": p.pid, "name": p.info["name"], "cpu_percent": round(pct)})
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return {"load_average_1m": load, "cpu_count": os.cpu_count(),
            "busy_processes": sorted(busy, key=lambda b: -b["cpu_percent"])}


def contention(env: dict) -> str | None:
    """A one-line warning when a run's ``environment`` (with load_before/after) shows a contended machine:
    another busy process before or after it, or a 1-minute load average above the CPU count + 1 after it (more
    runnable threads than cores, beyond the run's own). None if quiet."""
    samples = [env[k] for k in ("load_before", "load_after") if k in env]
    busy = {f"{b['name']} ({b['cpu_percent']}%)" for s in samples for b in s["busy_processes"]}
    after = env.get("load_after", {})
    over = after.get("load_average_1m") is not None and after["load_average_1m"] > (after.get("cpu_count") or 1) + 1
    if not busy and not over:
        return None
    why = ([f"other busy processes: {', '.join(sorted(busy))}"] if busy else []) + (
        [f"load average {after['load_average_1m']} on {after['cpu_count']} CPUs"] if over else [])
    return f"the machine was contended during this wall-clock run ({'; '.join(why)}): its timings may be inflated"


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


MACHINE_KEYS = ("cpu_model", "cpu_id", "cpu_isa", "cpu_count", "machine", "gpu", "torch", "minibatch")  # what a
# step's speed depends on
LATER_KEYS = ("cpu_id", "cpu_isa")  # recorded only since they were added: a profile without them gets no line


def machine_differences(recorded: dict, current: dict) -> list[str]:
    """How the machine and engine a profile was measured on (its ``environment``) differ from ``current``
    (``environment()``): one "key: recorded -> current" per MACHINE_KEYS entry that differs, one line per
    entry the profile did not record (older profiles lack cpu_model and minibatch), except the LATER_KEYS, which
    profiles record only since they were added, and, where both name their commit and git can tell, one line if the
    engine's code (ENGINE_PATHS) changed between them."""
    out = []
    for key in MACHINE_KEYS:
        if key not in current and key not in recorded:
            continue
        if key not in recorded:
            if key not in LATER_KEYS:
                out.append(f"{key} not recorded")
        elif recorded[key] != current.get(key):
            out.append(f"{key}: {recorded[key]} -> {current.get(key)}")
    if recorded.get("commit") and current.get("commit") and recorded["commit"] != current["commit"]:
        changed = engine_changes_since(recorded["commit"])
        if changed:
            out.append(f"engine code changed since commit {recorded['commit']}: {len(changed)} files under "
                       + ", ".join(sorted({p for p in ENGINE_PATHS if any(c.startswith(p) for c in changed)})))
    return out
