"""Validate the calibrated simulator against measured runs on held-out traces.

    python -m minibatch calibrate --model smollm2-135m --threads 1 --draft-model smollm2-135m-draft --dtype float32
    python benchmarks/validate_sim.py --threads 1 --measured data/cpu/sim_validation_measured.json \
        --json data/cpu/sim_validation.json
    python benchmarks/validate_sim.py --resimulate --measured data/cpu/sim_validation_measured.json \
        --json data/cpu/sim_validation.json          (a new profile, the same measured runs)

--repeat OTHER.json (an earlier measurement of the same traces) adds the run-to-run difference of
the measurements themselves: on a shared CPU the same step's time varies by several percent from
run to run, and no simulator can be closer to one run than the runs are to each other.

Each trace is a ShareGPT-length Poisson trace made with a seed the calibration never used
(calibration: seed 1234 and synthetic batches). Every policy runs twice on it: measured (the real
model, WallClock) and simulated (no model, the profile's clock); ``minibatch.sim.validate`` reports
the relative error of output throughput and TTFT p50 (the tolerance: within 15%).
Use the same --threads as the calibration: the profile is only valid for the setting it measured.

Read TTFT p50 with the machine's speed in mind: "step-time replay" is how much slower the profile
prices the run's own steps than they ran (by kind: prefill-only / mixed / decode-only steps), and
"at measured speed" simulates again with the profile scaled to the run's measured speed. On a
shared CPU the speed moves by several percent between calibration and validation (more while
others run); throughput follows the step times about 1:1, but TTFT p50 of 32 loaded requests moves
several times as much, so a TTFT error that vanishes at the measured speed is the machine's drift,
not the cost model's. "mechanics" (the simulation given the measured step times) is ~0: both
clocks stamp tokens, admit arrivals and skip idle gaps with the same engine code.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import time

from minibatch.checks import OneLineParser, comma_list, int_arg, output_file_arg
from minibatch.compare import CompareConfig, build_trace
from minibatch.experiment import load_draft_runner
from minibatch.experiment import load_runner, warm_up
from minibatch.report import environment, machine_load, write_json
from minibatch.files import check_output_file, read_json
from minibatch.sim.cost_model import Profile
from minibatch.sim.validate import compare_runs, measure_policy, simulate_measured

# name -> CompareConfig overrides of the main job's trace (ShareGPT lengths, Poisson arrivals at 4 req/s, seed 0)
TRACES = {
    "default-rate4-seed0": dict(num_requests=32, rate=4.0, seed=0),
    "rate8-seed1": dict(num_requests=32, rate=8.0, seed=1),
    "long-prompts-rate1-seed2": dict(num_requests=20, rate=1.0, seed=2, long_prompts=2, long_prompt_len=768),
    "rate2-seed3": dict(num_requests=32, rate=2.0, seed=3),
    "rate6-seed4": dict(num_requests=32, rate=6.0, seed=4),
}
POLICIES = ("static", "orca", "paged", "prefill_first", "chunked", "spec_ngram", "spec")


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", default=None, help="default data/profiles/<model>-cpu.json")
    p.add_argument("--traces", default=",".join(list(TRACES)[:2]), help=f"comma-separated subset of {','.join(TRACES)}")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--threads", type=int_arg(1, 1024), default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="measure in this dtype (default profile: data/profiles/<model>-cpu[-bfloat16].json)")
    p.add_argument("--max-num-batched-tokens", type=int_arg(1, 1 << 20), default=128,
                   help="chunked policy's token budget")
    p.add_argument("--measured", default=None,
                   help="JSON of the measured runs (with every step): written after measuring, "
                        "or read with --resimulate")
    p.add_argument("--resimulate", action="store_true",
                   help="no model: read --measured and simulate its traces again (e.g. with a new profile)")
    p.add_argument("--repeat", default=None,
                   help="another --measured file of the same traces (an earlier run): the report adds the "
                        "run-to-run difference of the measurements, the noise floor of any simulator")
    p.add_argument("--json", type=output_file_arg, default=None,
                   help="the report: measured vs simulated, errors (no steps)")
    args = p.parse_args(argv)
    for option, given, known in (("--traces", args.traces, TRACES), ("--policies", args.policies, POLICIES)):
        unknown = [x for x in comma_list(given, option) if x not in known] or ([] if given.strip() else [""])
        if unknown:  # now, not after the model loaded and the traces before it were measured
            p.error(f"{option} must be a comma-separated subset of {','.join(known)}, got {unknown[0]!r}")
    if args.measured and not args.resimulate:
        check_output_file(args.measured, "--measured")
    repeat = read_json(args.repeat, "measurement") if args.repeat else None
    load_before = machine_load()  # how busy the machine was: recorded with the result
    suffix = "" if args.dtype == "float32" else "-" + args.dtype
    profile_path = args.profile or f"data/profiles/{args.model}-cpu{suffix}.json"  # as the report names it
    root = Path(__file__).resolve().parents[1]  # the default: the repository's profile, from any working directory
    profile = Profile.load(profile_path if args.profile or Path(profile_path).exists() else root / profile_path)
    if args.resimulate:
        if not args.measured:
            p.error("--resimulate needs --measured")
        measured = read_json(args.measured, "measurement")
        tokenizer, vocab_size = None, profile.vocab_size
    else:
        measured = {"command": "python " + " ".join(sys.argv), "environment": environment(), "model": args.model,
                    "dtype": args.dtype, "max_num_batched_tokens": args.max_num_batched_tokens, "traces": {}}
        model, tokenizer, runner, _ = load_runner(args.model, threads=args.threads, dtype=args.dtype)
        vocab_size = model.config.vocab_size
        policies = [x for x in args.policies.split(",") if x]
        draft_runner = None
        if "spec" in policies:
            draft_runner = load_draft_runner("smollm2-135m-draft" if args.model == "smollm2-135m" else args.model,
                                             args.model, model, tokenizer)
        warm_up(runner, draft_runner)
    result = {"command": "python " + " ".join(sys.argv), "measured_command": measured["command"],
              "environment": measured["environment"], "profile": profile_path,
              "profile_command": profile.meta.get("command"), "model": measured["model"],
              "dtype": measured.get("dtype", "float32"), "traces": {}}
    if repeat is not None:
        result["repeat_command"] = repeat["command"]
    names = list(measured["traces"]) if args.resimulate else args.traces.split(",")
    for name in names:
        cfg = CompareConfig(model=measured["model"], check_reference=False, figures_dir=None, progress=False,
                            policies=("chunked",),  # the token budget is the chunked policy's setting
                            settings={"max_num_batched_tokens": measured["max_num_batched_tokens"]}, **TRACES[name])
        requests = build_trace(cfg, tokenizer, vocab_size)
        rows = []
        measured_rows = measured["traces"][name]["policies"] if args.resimulate else []
        for policy in ([r["policy"] for r in measured_rows] if args.resimulate else policies):
            t = time.perf_counter()
            if not args.resimulate:
                measured_rows.append(measure_policy(policy, cfg, runner, requests, draft_runner))
                measured_rows[-1]["run_time_s"] = round(time.perf_counter() - t, 1)
            m = next(r for r in measured_rows if r["policy"] == policy)
            row = {k: v for k, v in simulate_measured(m, cfg, requests, profile).items() if k != "steps"}
            if repeat is not None:  # (earlier measurement - this one) / this one
                other = next(r for r in repeat["traces"][name]["policies"] if r["policy"] == policy)
                row["repeat_error"] = compare_runs(row["measured"], other["measured"])
            rows.append(row)
            print_row(name, row)
        if not args.resimulate:
            measured["traces"][name] = {"config": TRACES[name], "num_requests": len(requests),
                                        "policies": measured_rows}
            if args.measured:  # after every trace: a crash later keeps what was measured
                measured["environment"] = environment(load_before)
                write_json(measured, args.measured)
        result["traces"][name] = {"config": TRACES[name], "num_requests": len(requests), "policies": rows}
    for key, what in (("error", "simulated vs measured"), ("error_at_measured_speed", "simulated at measured speed"),
                      ("repeat_error", "measured vs measured again")):
        errs = [abs(r[key][m]) for t in result["traces"].values() for r in t["policies"] if r.get(key)
                for m in ("output_throughput_tok_s", "ttft_p50_s")]
        if errs:
            result[f"mean_abs_{key}"], result[f"max_abs_{key}"] = sum(errs) / len(errs), max(errs)
            print(f"|{what}| of output throughput and TTFT p50: mean {result[f'mean_abs_{key}']:.1%}, "
                  f"max {result[f'max_abs_{key}']:.1%}")
    write_json(result, args.json)
    return 0


def print_row(name: str, row: dict) -> None:
    """One policy's line: measured vs simulated output throughput and TTFT p50, the step-time
    replay (all steps, then prefill / mixed / decode steps) and the errors at the measured speed."""
    e, fmt = row["error"], (lambda x: "-" if x is None else format(x, "+.1%"))
    line = (f"{name:<26} {row['policy']:<14} out tok/s {row['measured']['output_throughput_tok_s']:7.2f} "
            f"sim {row['simulated']['output_throughput_tok_s']:7.2f} ({e['output_throughput_tok_s']:+.1%})  "
            f"TTFT p50 {row['measured']['ttft_p50_s']:6.3f} s sim {row['simulated']['ttft_p50_s']:6.3f} "
            f"({e['ttft_p50_s']:+.1%})  step-time replay {fmt(row['replay_error'])}")
    if row.get("error_at_measured_speed"):
        kinds, speed = row["replay_error_by_kind"], row["error_at_measured_speed"]
        line += (f" (prefill {fmt(kinds['prefill'])}, mixed {fmt(kinds['mixed'])}, decode {fmt(kinds['decode'])})"
                 f"  at measured speed: out tok/s {speed['output_throughput_tok_s']:+.1%} "
                 f"TTFT p50 {speed['ttft_p50_s']:+.1%}  mechanics TTFT {row['mechanics_error']['ttft_p50_s']:+.2%}")
    print(line, flush=True)


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
