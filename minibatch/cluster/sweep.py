"""``python -m minibatch sweep --grid GRID.yaml``: many ``simulate`` (or ``compare``) runs, one table.

A grid file (YAML or JSON) names the command, the options every run shares, and either a grid (every combination
of the listed values) or an explicit list of configurations, or both::

    command: simulate
    base: {profile: data/profiles/smollm2-135m-cpu.json, policies: paged_prefix, workload: multiturn}
    grid: {router: [round_robin, prefix_affinity], rate: [1, 2, 4], seed: [0, 1]}
    configs: [{router: least_kv, rate: 8}]        # optional, added to the grid's

Keys are the command's option names with underscores (``max_num_seqs: 8`` is ``--max-num-seqs 8``;
``check_reference: false`` is ``--no-reference``), plus ``threads`` and ``policy_module``. Each configuration is
one task: in this process by default, on a local Ray instance with ``--ray`` (``ray.init()``), on a Ray cluster
with ``--ray-address ADDR`` (every node needs minibatch installed). A task declares what it uses: 1 CPU for a
simulation; a wall-clock ``compare`` declares its ``threads`` (default 1) and runs with that many torch threads, so
Ray never packs two on a core. Rows stream into the table as tasks finish (tqdm). A task that fails (an error, or
a worker that dies) is reported with its configuration and does not lose the other rows. Every finished
configuration is stored under ``--cache`` keyed by its configuration, the content of the files it names (a profile,
a trace, each file of a list) and the code version (package version, git commit, a hash of uncommitted changes to
the package's code), so a rerun computes only what is missing. A wall-clock ``compare`` run on a contended machine
keeps its warning in its rows (``contended``), and the table says how many.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from minibatch.checks import check_int
from minibatch.cluster.grid import acceptance_text, check_keys, load_grid
from minibatch.files import atomic_write_text


def code_version(root: Path | None = None) -> str:
    """Package version + git commit + "-dirty." and a hash of the uncommitted changes to the package's tracked code
    (``minibatch/``, ``pyproject.toml``; not the results a sweep writes into ``data/``) when there are any: a rerun
    key, so other code or other uncommitted edits mean new runs. A plug-in file is keyed by its content instead."""
    from minibatch import __version__

    root = root or Path(__file__).resolve().parents[2]  # (a test gives a repository of its own)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=30).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--binary", "--no-ext-diff", "--", "minibatch", "pyproject.toml"],
                              cwd=root, capture_output=True, timeout=30).stdout if commit else b""  # (code only)
    except (OSError, subprocess.SubprocessError):
        commit, diff = "", b""
    dirty = f"-dirty.{hashlib.sha256(diff).hexdigest()[:12]}" if diff else ""  # two different edits: two versions
    return f"{__version__}+{commit[:12] or 'nogit'}{dirty}"


def config_key(command: str, config: dict, version: str) -> str:
    """The cache key of one configuration: its options, the code version and the content of every file an option
    names (a profile recalibrated in place, or a trace rewritten, is a new configuration)."""
    named = {f"{k}[{i}]": v for k, value in sorted(config.items())  # a list of files (policy_module) too
             for i, v in enumerate(value if isinstance(value, list) else [value])}
    files = {k: hashlib.sha256(Path(v).read_bytes()).hexdigest() for k, v in named.items()
             if isinstance(v, str) and Path(v).is_file()}
    text = json.dumps({"command": command, "config": config, "code": version, "files": files}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def run_one(command: str, config: dict) -> dict:
    """One configuration, in this process: the command's own function with these option values (and --json
    into a temporary file), its printing swallowed; returns that JSON. ``threads``: torch threads for the run;
    ``policy_module``: a file (or list) registering policies, backends or routers, loaded first.

    Raises:
        ValueError: an option the command does not have, or what the command raises for a bad value."""
    from minibatch.cluster.simulate import ClusterConfig, simulate
    from minibatch.compare import compare_config, run_compare

    kind, ours, cluster, settings = check_keys(command, config)  # (and loads its policy_module)
    config = dict(config)
    threads = config.pop("threads", None)
    config.pop("policy_module", None)  # loaded by check_keys
    acceptance = acceptance_text(config.pop("acceptance_rate", None))
    if threads is not None and check_int(threads, "threads", 1, 1024) and command == "simulate":
        raise ValueError("'threads' applies to compare configurations (simulate runs no model)")
    if threads is not None:
        import torch
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        values = {"figures_dir": None} | {k: v for k, v in config.items() if k in ours} | {"json_path": out,
                                                                                           "progress": False}
        cfg = compare_config(values, kind, {k: v for k, v in config.items() if k in settings},
                             f"python -m minibatch sweep: {command} {json.dumps(config, default=str)}")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if command == "compare":
                run_compare(cfg)
            else:
                simulate(cfg, ClusterConfig(**{k: v for k, v in config.items() if k in cluster}), acceptance)
        return json.loads(Path(out).read_text(encoding="utf-8"))


def rows_of(config: dict, result: dict) -> list[dict]:
    """Table rows of one configuration's result: one per policy, the configuration's values first, then the
    overall metrics (a cluster's "overall", or simulate's and compare's row)."""
    rows = []
    for policy, entry in result.get("policies", {}).items():
        metrics = entry.get("overall", entry)
        rows.append({k: v for k, v in config.items() if k != "policies"} | {"policy": policy} |
                    {k: v for k, v in metrics.items() if isinstance(v, (int, float, str)) or v is None} |
                    ({"contended": result["contended"]} if result.get("contended") else {}))
    return rows


def run_sweep(grid_path: str, *, use_ray: bool = False, ray_address: str | None = None, cache_dir: str | None = None,
              json_path: str | None = None, progress: bool = True) -> dict:
    """Run every configuration of ``grid_path`` (see the module docstring); returns {"rows", "failed", "cached",
    "computed", "code_version", ...} and writes it to ``json_path`` unless every configuration failed and a file is
    there already (an earlier table is not replaced by an empty one; each finished configuration is also in
    ``cache_dir`` at once, so an interrupted sweep keeps what it finished). Raises ValueError: a bad grid file, a
    ``ray_address`` nothing answers at."""
    from tqdm.auto import tqdm

    from minibatch.report import write_json

    if ray_address is not None:  # before Ray retries an address nothing answers for minutes
        check_ray_address(ray_address)
    command, configs = load_grid(grid_path)
    version = code_version()
    cache = Path(cache_dir or default_cache(grid_path, json_path))
    cache.mkdir(parents=True, exist_ok=True)
    results: dict[int, dict] = {}
    failed: list[dict] = []
    todo = []
    for i, config in enumerate(configs):
        file = cache / f"{config_key(command, config, version)}.json"
        try:
            entry = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # not there yet, or unreadable (a write cut short before writes were atomic)
            entry = None
        if isinstance(entry, dict) and isinstance(entry.get("config"), dict) and isinstance(entry.get("result"), dict):
            results[i] = entry
        else:  # (an entry of another shape, e.g. edited by hand, is computed again)
            todo.append((i, config, file))
    cached = len(results)
    bar = tqdm(total=len(configs), initial=cached, desc="sweep", unit="config", disable=not progress)

    def done(i, config, file, result=None, error=None):
        if error is None:
            results[i] = {"config": config, "result": result}
            atomic_write_text(file, json.dumps(results[i], default=str))
        else:
            failed.append({"index": i, "config": config, "error": error})
            bar.write(f"failed: configuration {i} {json.dumps(config, default=str)}: {error}")
        bar.update(1)

    if use_ray or ray_address:
        run_on_ray(command, todo, done, ray_address)
    else:
        for i, config, file in todo:
            try:
                done(i, config, file, run_one(command, config))
            except Exception as e:  # noqa: BLE001 - one configuration's failure must not lose the others
                done(i, config, file, error=f"{type(e).__name__}: {e}")
    bar.close()
    rows = [row for i in sorted(results) for row in rows_of(results[i]["config"], results[i]["result"])]
    varying = [k for k in dict.fromkeys(k for c in configs for k in c)
               if len({json.dumps(c.get(k), sort_keys=True, default=str) for c in configs}) > 1]
    invocation = " ".join(["python -m minibatch sweep --grid", str(grid_path)] + (["--ray"] if use_ray else [])
                          + (["--ray-address", ray_address] if ray_address else [])
                          + (["--json", str(json_path)] if json_path else []))
    out = {"invocation": invocation, "grid": str(grid_path), "command": command, "code_version": version,
           "num_configs": len(configs),
           "varying": varying,
           "cached": cached, "computed": len(todo) - len(failed), "failed": sorted(failed, key=lambda f: f["index"]),
           "rows": rows}
    if results or json_path is None or not Path(json_path).exists():
        write_json(out, json_path)
    else:  # every configuration failed: an earlier table there is not replaced by an empty one
        print(f"every configuration failed: {json_path} is left as it was", file=sys.stderr)
    return out


def default_cache(grid_path: str, json_path: str | None) -> Path:
    """The folder of finished configurations when --cache is not given: --json's path (else the grid's) with the
    suffix .cache."""
    return Path(json_path or grid_path).with_suffix(".cache")


def run_on_ray(command: str, todo: list, done, address: str | None) -> None:
    """Each configuration as a Ray task (no retries: a crash is reported, not run again), collected as they
    finish."""
    import ray

    if not ray.is_initialized():
        root = str(Path(__file__).resolve().parents[2])  # workers import this very minibatch
        ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": root}}, log_to_driver=False,
                 include_dashboard=False)
    task = ray.remote(max_retries=0)(run_one)
    pending = {}
    for i, config, file in todo:
        cpus = int(config.get("threads") or 1) if command == "compare" else 1
        pending[task.options(num_cpus=cpus).remote(command, config)] = (i, config, file)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        i, config, file = pending.pop(ready[0])
        try:
            done(i, config, file, ray.get(ready[0]))
        except Exception as e:  # noqa: BLE001 - a task's error or a dead worker: reported, the rest go on
            done(i, config, file, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}")


def check_ray_address(address: str) -> None:
    """Raise ValueError (naming --ray-address) unless ``address`` is "auto", "local" or a host:port (``ray://host``
    with Ray Client's port 10001 by default; ``[::1]:6379``) that answers a TCP connection within 5 s: Ray itself
    retries an unreachable address for minutes."""
    import socket

    if address in ("auto", "local"):
        return
    rest = address.removeprefix("ray://")
    if rest.startswith("["):  # an IPv6 address: [::1]:6379
        host, _, port = rest[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    if not port and address.startswith("ray://"):
        port = "10001"  # Ray Client's default port
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address must be auto, local or host:port (ray://host[:port] for Ray Client), got "
                         f"{address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ValueError(f"--ray-address {address}: nothing answers there ({e.strerror or e})") from None


def add_sweep_arguments(p) -> None:
    p.add_argument("--grid", required=True, help="a YAML or JSON grid file (see python -m minibatch.cluster.sweep)")
    p.add_argument("--ray", action="store_true", help="run the configurations as tasks on a local Ray instance")
    p.add_argument("--ray-address", default=None, help="run them on this Ray cluster (ray.init(address=...))")
    p.add_argument("--cache", default=None, help="where finished configurations are kept (default: --json's path, "
                   "else --grid's, with the suffix .cache)")
    p.add_argument("--json", dest="json_path", default=None, help="write the table as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def sweep_command(args) -> int:
    """``python -m minibatch sweep``: run, print the table (one row per configuration and policy)."""
    from minibatch.files import check_output_dir, check_output_file

    if args.json_path is not None:
        check_output_file(args.json_path, "--json")
    if not args.grid.strip():
        raise ValueError("--grid must be a YAML or JSON grid file, got ''")
    cache = args.cache if args.cache is not None else default_cache(args.grid, args.json_path)
    if args.json_path is not None and Path(cache) == Path(args.json_path):
        raise ValueError(f"--json {args.json_path}: the folder of finished configurations would have this name too; "
                         "give another --json name, or a --cache")
    check_output_dir(cache, "--cache" if args.cache is not None else f"--cache (default {cache})")
    out = run_sweep(args.grid, use_ray=args.ray, ray_address=args.ray_address, cache_dir=str(cache),
                    json_path=args.json_path, progress=not args.no_progress)
    metrics = ("policy", "output_throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "prefix_cache_hit_rate")
    columns = ([k for k in out["varying"] if k != "policies"]  # (each row's policy is in its own column)
               + [k for k in metrics if any(k in row for row in out["rows"])])
    print(" ".join(f"{k:>22}" for k in columns))
    for row in out["rows"]:
        cells = [round(v, 4) if isinstance(v := row.get(k), float) else v for k in columns]
        print(" ".join(f"{'-' if c is None else c!s:>22}" for c in cells))
    if contended := sum(bool(row.get("contended")) for row in out["rows"]):
        print(f"warning: {contended} of {len(out['rows'])} rows were timed on a contended machine; their timings may "
              "be inflated (each row's 'contended' in --json says why)")
    print(f"{out['num_configs']} configurations: {out['cached']} cached, {out['computed']} computed, "
          f"{len(out['failed'])} failed (code {out['code_version']})")
    return 1 if out["failed"] else 0
