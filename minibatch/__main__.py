"""Command line (see ``--help`` of each):

    python -m minibatch compare     one trace through every policy on the real model (the main job)
    python -m minibatch calibrate   measure step times on this machine, fit the simulator's cost model
    python -m minibatch simulate    a trace through our schedulers with no model, on a calibrated clock
    python -m minibatch serve       an OpenAI-compatible server on the engine (streaming, /metrics)
    python -m minibatch bench-serve a load generator against any OpenAI-compatible server
    python -m minibatch profile     where a step's time goes: its components, on this machine's roofline
    python -m minibatch gpu-check   everything that must work on a GPU (CPU twins without one), one JSON
    python -m minibatch sweep       a grid of simulate/compare runs, one table (in-process or on Ray)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from minibatch.cluster.simulate import ClusterConfig, simulate_command
from minibatch.checks import OneLineParser, given_options, one_line
from minibatch.cluster.sweep import add_sweep_arguments, sweep_command
from minibatch.compare import COMPARE_SETTINGS, SIM_DEFAULT_POLICIES, CompareConfig, compare_config, run_compare
from minibatch.config import choices_of, opt, setting_fields
from minibatch.experiment import all_policies, policy_spec
from minibatch.experiments.step_profile import add_profile_arguments, profile_command
from minibatch import POLICIES, load_policy_module
from minibatch.models import ModelConfig
from minibatch.precision import dtype_name, resolve_dtype
from minibatch.serving.bench import add_bench_serve_arguments, run_bench_serve
from minibatch.serving.launch import add_serve_arguments, run_serve


# compare's and simulate's defaults for settings, shown in --help
COMPARE_HELP_DEFAULTS = COMPARE_SETTINGS | {"n_slots": "batch_size x the longest request (compare.kv_slots)"}


def add_config_options(p: argparse.ArgumentParser, command: str, config_cls=CompareConfig, omit=()) -> None:
    """One option per ``config_cls`` field offered to ``command`` ("model": compare, or serve and calibrate
    with ModelConfig; "sim": simulate), except the fields in ``omit``, with the field's help and default; the
    values are checked by the config itself."""
    for f in dataclasses.fields(config_cls):
        m = f.metadata
        if m.get("cli") not in ("all", command) or f.name in omit:
            continue
        default = SIM_DEFAULT_POLICIES if command == "sim" and f.name == "policies" else f.default
        flag = m["flag"] or opt(f.name)
        if m["kind"] == "bool":
            # a flag that turns a default-on setting off says so: "--no-reference: do not compare ..."
            shown = f"turn off (on by default): {m['help']}" if default else m["help"]
            p.add_argument(flag, dest=f.name, action="store_false" if default else "store_true", help=shown)
            continue
        kind = {"int": int, "real": float}.get(m["kind"], str)
        shown = ",".join(default) if f.name == "policies" else default
        metavar = "{" + ",".join(choices_of(m)) + "}" if m["kind"] == "choice" else f.name.upper()
        p.add_argument(flag, dest=f.name, type=kind, default=shown, metavar=metavar,
                       required=command == "sim" and f.name == "profile",  # simulate prices its steps by it
                       help=f"{m['help']} (default: {shown})" if shown not in (None, "") else m["help"])
    if config_cls is not CompareConfig:
        return
    p.add_argument("--policy-module", action="append", default=[], metavar="FILE.py",
                   help="a Python file registering policies, attention backends, routers or queue policies; repeatable")


def add_settings_options(p: argparse.ArgumentParser, specs: list, defaults: dict | None = None) -> None:
    """One option per setting of the policies ``specs`` (PolicySpecs or Baselines: their config
    classes' fields), its help from the first config that declares it, the policies that have it and
    their defaults (``defaults``: the command's own, e.g. compare's). An option not given is not set
    (argparse.SUPPRESS), so each policy keeps its own default."""
    group = p.add_argument_group("policy settings (each applies to every selected policy that has it)")
    declared: dict[str, list] = {}
    for spec in specs:
        for f in dataclasses.fields(spec.config_cls):
            if f.metadata.get("cli"):
                declared.setdefault(f.name, []).append((spec.name, f))
    for name, users in declared.items():
        helps = [f.metadata["help"] for _, f in users]
        m = next(f.metadata for _, f in users if f.metadata["help"] == max(helps, key=helps.count))  # the usual one
        by_default: dict[str, list[str]] = {}
        for policy, f in users:
            by_default.setdefault(str((defaults or {}).get(name, f.default)), []).append(policy)
        shown = "; ".join(f"{d} ({','.join(ps)})" if len(by_default) > 1 else d for d, ps in by_default.items())
        having = [policy for policy, _ in users]
        others = [spec.name for spec in specs if spec.name not in having]
        where = "" if not others else f"; policies: {','.join(having)}" if len(having) <= len(others) \
            else f"; all policies but {','.join(others)}"
        help_text = f"{m['help']} (default: {shown}{where})"
        if m["kind"] == "bool":
            group.add_argument(opt(name), dest=name, action="store_true", default=argparse.SUPPRESS, help=help_text)
            continue
        metavar = "{" + ",".join(choices_of(m)) + "}" if m["kind"] == "choice" else name.upper()
        group.add_argument(opt(name), dest=name, type={"int": int, "real": float}.get(m["kind"], str),
                           default=argparse.SUPPRESS, metavar=metavar, help=help_text)


def settings_from_args(args, specs: list) -> dict:
    """The policy settings given on the command line (those not given are absent)."""
    names = dict.fromkeys(name for spec in specs for name in setting_fields(spec.config_cls))
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def config_from_args(args, command: str, argv_text: str) -> CompareConfig:
    """The CompareConfig of parsed ``args``: every field the command offers and the policy settings
    given (``compare.compare_config``)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(CompareConfig)
              if f.metadata.get("cli") and hasattr(args, f.name)}
    return compare_config(values, command, settings_from_args(args, [policy_spec(p) for p in all_policies()]),
                          argv_text)


def check_calibrate_modes(parser, args) -> None:
    """calibrate: --refit measures nothing and --draft-only measures the profile's own model's draft, so options
    they would silently ignore are refused (one given at its default value cannot be told apart and passes)."""
    for name in ("refit", "draft_only", "out"):  # '' would read as not given (--refit '': a full calibration)
        if (path := getattr(args, name)) is not None and not path.strip():
            raise ValueError(f"{opt(name)} must be a file path (leave it out if not wanted), got {path!r}")
    measuring = [f.name for f in dataclasses.fields(ModelConfig)] + ["threads", "scale", "quick", "draft_only"]
    ignored = {"refit": measuring, "draft_only": ["model", "dtype", "attention_backend", "quick", "enforce_eager"]}
    for mode in ("refit", "draft_only"):
        if getattr(args, mode) and (given := given_options(parser, args, ignored[mode], ("calibrate",))):
            raise ValueError(f"{opt(given[0])} does not apply with {opt(mode)} (it "
                             + ("fits the stored samples again, measuring nothing)" if mode == "refit" else
                                "measures the draft of the profile's own model and dtype)"))


def model_config(args) -> ModelConfig:
    """The ModelConfig of parsed ``args`` (serve, calibrate): checked before minutes of loading."""
    return ModelConfig(**{f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(ModelConfig)})


def load_plugins(argv: list[str] | None) -> None:
    """Load every ``--policy-module FILE`` of ``argv`` before the parser is built, so the policies'
    own settings become options. Raises ValueError (a bad file, one line)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--policy-module", action="append", default=[])
    for path in pre.parse_known_args(argv)[0].policy_module:
        load_policy_module(path)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="minibatch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare",
                       help="run one trace through our policies and the Hugging Face peer, on the real model")
    add_config_options(c, "model")
    add_settings_options(c, [policy_spec(p) for p in all_policies()], COMPARE_HELP_DEFAULTS)
    s = sub.add_parser("simulate", help="run a trace through our schedulers with no model, on a calibrated clock")
    add_config_options(s, "sim")
    add_settings_options(s, list(POLICIES.values()), COMPARE_HELP_DEFAULTS)
    s.add_argument("--acceptance-rate", default=None,
                   help="spec policies: acceptance rate, or comma-separated per-position rates")
    add_config_options(s.add_argument_group("cluster (replicas behind a router; disaggregated prefill/decode)"),
                       "sim", ClusterConfig)
    k = sub.add_parser("calibrate",
                       help="measure step times of a model on this machine and fit the simulator's cost model")
    add_config_options(k, "model", ModelConfig)  # --model, --device, --dtype, --attention-backend, --draft-model
    k.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    k.add_argument("--scale", type=float, default=1.0, help="shrink the calibration workloads, in (0, 1]")
    k.add_argument("--quick", action="store_true", help="fewer sizes and steps on every axis (about a quarter of "
                   "the time; benchmarks/validate_sim.py --profile compares it with the full fit)")
    k.add_argument("--out", default=None, help="profile JSON (default data/profiles/<model>-<device>.json in "
                   "float32, <model>-<device>-<dtype>.json otherwise; -<backend>, -quick, -scale<S>, -eager "
                   "added for those options, so a variant never replaces the full profile)")
    k.add_argument("--draft-only", default=None, metavar="PROFILE",
                   help="measure only --draft-model and add it to this profile (writes --out or PROFILE)")
    k.add_argument("--refit", default=None, metavar="PROFILE",
                   help="no measuring: fit this profile's stored samples again with the current code "
                        "(writes --out or PROFILE)")
    k.add_argument("--no-progress", action="store_true", help="no progress bars")
    v = sub.add_parser("serve", help="an OpenAI-compatible server on the engine (completions, chat, SSE, /metrics)")
    add_serve_arguments(v)
    add_config_options(v, "model", ModelConfig, omit=("attention_backend",))  # (serve's own default)
    add_settings_options(v, list(POLICIES.values()))
    b = sub.add_parser("bench-serve", help="measure TTFT, ITL, TPOT and goodput of any OpenAI-compatible server")
    add_bench_serve_arguments(b)
    pr = sub.add_parser("profile", help="where a step's time goes: components of decode and prefill steps, roofline")
    add_config_options(pr, "model", ModelConfig, omit=("draft_model", "enforce_eager"))  # own steps, eager
    add_profile_arguments(pr)
    add_sweep_arguments(sub.add_parser("sweep", help="a grid of simulate/compare runs, one table (or on Ray)"))
    g = sub.add_parser("gpu-check", help="everything that must work on a GPU, in one command: kernels compiled, "
                       "cuda tests, equality with HF generate, the main job, a benchmark (CPU twins without a GPU)")
    g.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda where there is one)")
    g.add_argument("--out", default=None, help="result JSON, written once every step has run (default "
                   "data/gpu/gpu_check_<device name>[.<steps>].json; the steps so far: NAME.partial.json)")
    g.add_argument("--steps", default=None, help="comma-separated subset of the steps (default: all)")
    g.add_argument("--bench-requests", type=int, default=None,
                   help="requests in the benchmark step's trace (default 64 on a GPU, 16 on CPU)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line. Returns 0 when done; otherwise raises SystemExit (as argparse does) with
    code 2 for a bad option or input (one line on stderr naming it, checked before any model
    loads where it can be), 1 for a failed file write or a failed gpu-check step, 130 when
    interrupted (Ctrl-C: one line, and no partial output file: every write is atomic)."""
    try:
        load_plugins(argv)
    except ValueError as e:
        print(f"minibatch: error: {one_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = f"{parser.prog} {args.command}"
    try:
        return _run(parser, args, argv)
    except KeyboardInterrupt:
        print(f"{sub}: interrupted", file=sys.stderr)
        code = 130
    except (ValueError, TypeError, NotImplementedError, FileNotFoundError, IsADirectoryError) as e:
        print(f"{sub}: error: {one_line(e)}", file=sys.stderr)
        code = 2
    except OSError as e:  # a write failed (disk full, permissions), a model could not be fetched
        print(f"{sub}: error: {one_line(e)}", file=sys.stderr)
        code = 1
    except MemoryError:
        print(f"{sub}: error: out of memory (use fewer requests, shorter lengths or fewer KV slots)", file=sys.stderr)
        code = 1
    raise SystemExit(code)


def _run(parser: argparse.ArgumentParser, args, argv: list[str] | None) -> int:
    from minibatch.checks import check_int, check_real, comma_list
    from minibatch.files import check_output_file

    command = " ".join(["python -m minibatch"] + (argv if argv is not None else sys.argv[1:]))
    if args.command == "serve":
        model_config(args)
        return run_serve(args, settings_from_args(args, list(POLICIES.values())))
    if args.command == "bench-serve":
        run_bench_serve(args, command)
        return 0
    if args.command == "sweep":
        return sweep_command(args)
    if args.command == "profile":
        model_config(args)
        profile_command(args, command)
        return 0
    if args.command == "gpu-check":
        from minibatch.gpu_check import run_gpu_check

        if args.bench_requests is not None:
            check_int(args.bench_requests, "--bench-requests", 1, 100_000)
        if args.device is not None and not args.device.strip():
            raise ValueError("--device must be cuda, cuda:N or cpu (leave it out for cuda where there is one), got ''")
        steps = list(comma_list(args.steps, "--steps")) if args.steps is not None else None
        if steps == []:
            raise ValueError("--steps must name at least one step (leave it out for all)")
        if args.bench_requests is not None and steps is not None and "benchmark" not in steps:
            raise ValueError("--bench-requests applies only with the benchmark step (--steps ...,benchmark)")
        if args.out is not None:
            check_output_file(args.out, "--out")
        if not run_gpu_check(args.device, steps, args.bench_requests, out=args.out, command=command)["passed"]:
            raise SystemExit(1)  # a step failed: the summary above names it
        return 0
    if args.command in ("compare", "simulate"):
        cfg = config_from_args(args, "model" if args.command == "compare" else "sim", command)
        run_compare(cfg) if args.command == "compare" else simulate_command(args, cfg)
        return 0
    from minibatch.sim.calibrate import calibrate, calibrate_draft, default_profile_path, print_profile, refit
    from minibatch.sim.cost_model import Profile  # (calibrate from here on)

    model_config(args)  # --model, --device, --dtype, --attention-backend, --draft-model checked now
    if args.threads is not None:
        check_int(args.threads, "--threads", 1, 1024)
    check_real(args.scale, "--scale", 0.0, 1.0, low_open=True)
    check_calibrate_modes(parser, args)
    if args.out is not None:
        check_output_file(args.out, "--out")
    if args.draft_only:
        if not args.draft_model:
            raise ValueError("--draft-only needs --draft-model")
        base = Profile.load(args.draft_only)
        check_output_file(args.out or args.draft_only, "--out")
        given = given_options(parser, args, ["device", "scale"], ("calibrate",))  # others: the profile's
        profile = calibrate_draft(base, args.draft_model, args.device if "device" in given else None, args.threads,
                                  args.scale if "scale" in given else None, not args.no_progress)
        profile.meta["draft_command"] = command
        print_profile(profile)
        print(f"wrote {profile.save(args.out or args.draft_only)} (draft {args.draft_model} added)")
        return 0
    if args.refit:
        base = Profile.load(args.refit)
        check_output_file(args.out or args.refit, "--out")
        profile = refit(base)
        print_profile(profile)
        print(f"wrote {profile.save(args.out or args.refit)} (refit of {args.refit})")
        return 0
    dtype = dtype_name(resolve_dtype(args.dtype, args.device))
    out = args.out or default_profile_path(args.model, args.device, dtype, args.attention_backend, args.quick,
                                           args.scale, args.enforce_eager)
    check_output_file(out, "--out")
    profile = calibrate(args.model, args.device, args.threads, args.scale, args.draft_model,
                        progress=not args.no_progress, command=command, dtype=dtype,
                        attention_backend=args.attention_backend, quick=args.quick, enforce_eager=args.enforce_eager)
    print_profile(profile)
    print(f"wrote {profile.save(out)} ({profile.meta['calibration_time_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
