"""A sweep's grid file: its configurations, and the keys each may have (``python -m minibatch sweep``; the file's
format is in ``minibatch.cluster.sweep``). Everything here is checked before any configuration runs."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

from minibatch.checks import short_repr

COMMANDS = ("simulate", "compare")
MAX_CONFIGS = 100_000  # a grid's configurations (each a run): more is a typo, or a sweep for a cluster of its own
SWEPT = {"json_path": "the sweep writes each result (its --json: the table)", "progress": "--no-progress",
         "trace_out": "every configuration would write the same files",
         "figures_dir": "every configuration would draw into the same folder"}


def load_grid(path: str) -> tuple[str, list[dict]]:
    """(command, configurations) of a grid file.

    Raises:
        ValueError: not a readable YAML/JSON mapping, an unknown command, a grid value that is not a list, more
            than MAX_CONFIGS configurations or none, a key no configuration may have (:func:`check_keys`); each
            names the file and the key."""
    import yaml

    try:
        spec = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"--grid {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    if not isinstance(spec, dict) or not set(spec) <= {"command", "base", "grid", "configs"}:
        raise ValueError(f"--grid {path}: a mapping of command, base, grid and configs is expected")
    command = spec.get("command", "simulate")
    if command not in COMMANDS:
        raise ValueError(f"--grid {path}: command must be one of {', '.join(COMMANDS)}, got {command!r}")
    base, grid, extra = spec.get("base") or {}, spec.get("grid") or {}, spec.get("configs") or []
    if not isinstance(base, dict) or not isinstance(grid, dict) or not isinstance(extra, list):
        raise ValueError(f"--grid {path}: base and grid must be mappings, configs a list of mappings")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"--grid {path}: grid.{key} must be a non-empty list, got {values!r}")
        if len({json.dumps(same_number(v), sort_keys=True, default=str) for v in values}) < len(values):  # twice
            raise ValueError(f"--grid {path}: grid.{key} lists a value twice: {values!r}")
    count = (math.prod(len(v) for v in grid.values()) if grid else 0) + len(extra)
    if count > MAX_CONFIGS:
        raise ValueError(f"--grid {path}: {count} configurations, more than {MAX_CONFIGS}: split the grid")
    configs = [base | dict(zip(grid, point)) for point in itertools.product(*grid.values())] if grid else []
    configs += [base | c for c in extra if isinstance(c, dict)]
    if len(configs) != count:  # an entry of configs that is no mapping was left out
        raise ValueError(f"--grid {path}: every entry of configs must be a mapping")
    if not configs:
        raise ValueError(f"--grid {path}: no configuration (give grid or configs)")
    for i, config in enumerate(configs):  # every key, before anything runs (a typo failed every run, one by one)
        try:
            check_keys(command, config, load_modules=False)
        except ValueError as e:
            raise ValueError(f"--grid {path}: configuration {i} {json.dumps(config, default=str)}: {e}") from None
    return command, configs


def same_number(value):
    """``value`` with a float that is a whole number written as an int (1.0 -> 1: the same run as 1)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [same_number(v) for v in value] if isinstance(value, list) else value


def check_keys(command: str, config: dict, load_modules: bool = True) -> tuple[str, set, set, set]:
    """(kind, the command's options, the cluster's, the policies' settings) that ``config``'s keys may name; loads
    its ``policy_module`` first (its policies' settings are keys too). ``load_modules`` False (the grid's check in the
    driver, which need not import a Ray task's plug-ins): a config with a policy_module has its keys checked by its
    run.

    Raises:
        ValueError: a key that is no option of ``command`` or is the sweep's own, a ``disaggregate`` YAML read as a
            number (1:2 unquoted is 62 in base 60), an ``acceptance_rate`` that is no number or list of them."""
    from dataclasses import fields

    from minibatch.cluster.simulate import ClusterConfig
    from minibatch.compare import CompareConfig
    from minibatch.config import setting_fields
    from minibatch.experiment import all_policies, policy_spec
    from minibatch.plugins import load_policy_module

    modules = config.get("policy_module")
    for path in ([modules] if isinstance(modules, str) else modules or []) if load_modules else []:
        load_policy_module(path)
    kind = "model" if command == "compare" else "sim"
    ours = {f.name for f in fields(CompareConfig) if f.metadata.get("cli") in ("all", kind)}
    cluster = {f.name for f in fields(ClusterConfig) if f.metadata.get("cli")} if command == "simulate" else set()
    settings = {n for p in all_policies() for n in setting_fields(policy_spec(p).config_cls)}
    allowed = (ours | cluster | settings | {"threads", "policy_module"}) - set(SWEPT)
    allowed |= {"acceptance_rate"} if command == "simulate" else set()
    unknown = [k for k in config if k not in allowed] if load_modules or not modules else []
    if unknown:
        raise ValueError(f"{unknown[0]!r} is " + (f"the sweep's, not a configuration's: {SWEPT[unknown[0]]}"
                         if unknown[0] in SWEPT else f"not an option of {command} (keys are option names with "
                                                     "_, e.g. max_num_seqs)"))
    if isinstance(config.get("disaggregate"), int):
        raise ValueError(f"disaggregate must be a string P:D, got {config['disaggregate']!r}: YAML reads 1:2 "
                         "unquoted as a number (base 60); write \"1:2\"")
    acceptance_text(config.get("acceptance_rate"))
    return kind, ours, cluster, settings


def acceptance_text(value) -> str | None:
    """A grid's acceptance_rate as the command line writes it (0.5 -> "0.5", [0.6, 0.3] -> "0.6,0.3").

    Raises:
        ValueError: not a number, a string or a list of numbers (true is not a rate)."""
    if value is None or isinstance(value, str):
        return value
    number = (int, float)
    if isinstance(value, number) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list) and value and all(isinstance(v, number) and not isinstance(v, bool) for v in value):
        return ",".join(map(str, value))
    raise ValueError(f"acceptance_rate must be a number in [0, 1] or a list of them (one per draft position), got "
                     f"{short_repr(value)}")
