"""A set of step profiles of one decode shape, each in its own process: single profiles on a shared machine vary by
20-50% from minute to minute, so the README's "within 2x of the roofline bound" is judged on a set's median. Each
run is ``python -m minibatch profile --model MODEL --dtype DTYPE --attention-backend BACKEND --decode-batches BATCH
--prefill-lens '' --context-len CONTEXT --repeats REPEATS`` (its roofs measured in the same run, before, after and
between the steps); the JSON keeps every run's step, bound, roofs, components and load, and a summary: the medians
and how many runs were within 2x, at the run's roofs and at the roofs measured between its steps.

    python benchmarks/decode_step_runs.py --runs 6 --json data/cpu/step_profile_decode32_runs_<machine>_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from minibatch.checks import OneLineParser, int_arg, output_file_arg
from minibatch.report import environment, machine_load, write_json
from minibatch.runner.backends import backend_names


def one_run(args, path: str) -> dict:
    """One profile in a fresh interpreter; its shape's row, reduced to what a set compares (ms, GFLOP/s, GB/s)."""
    command = [sys.executable, "-m", "minibatch", "profile", "--model", args.model, "--dtype", args.dtype,
               "--attention-backend", args.attention_backend, "--decode-batches", str(args.batch), "--prefill-lens", "",
               "--repeats", str(args.repeats), "--context-len", str(args.context_len), "--json", path]
    done = subprocess.run(command, stdout=subprocess.DEVNULL)
    if done.returncode != 0:  # its own error is on stderr above
        raise ValueError(f"the profile exited with {done.returncode}: {' '.join(command[1:])}")
    with open(path) as f:
        profile = json.load(f)
    shape, roof = profile["shapes"][0], profile["roofline"]
    return {"step_ms": shape["step_s"] * 1e3, "bound_ms": shape["bound_s"] * 1e3,  # unrounded: a tiny model's bound
            "bound": shape["bound"], "peak_gflop_per_s": round(roof["peak_flop_per_s"] / 1e9, 1),
            "bytes_gb_per_s": round(roof["bytes_per_s"] / 1e9, 2), "step_over_bound": shape["step_over_bound"],
            "paired_steps_ms": [round(s * 1e3, 2) for s in shape["paired"]["step_s"]],
            "peak_gflop_per_s_during_steps": round(shape["peak_flop_per_s_during_steps"] / 1e9, 1),
            "bytes_gb_per_s_during_steps": round(shape["bytes_per_s_during_steps"] / 1e9, 2),
            "step_over_bound_during_steps": shape["step_over_bound_during_steps"],
            "components_ms": {k: round(v * 1e3, 2) for k, v in shape["components_s"].items()},
            "overhead_share": shape["overhead_share"],
            "load_average_1m_before": profile["environment"]["load_before"]["load_average_1m"]}


def summary(runs: list[dict]) -> dict:
    """The set's medians and how many of its runs were within 2x of their bound."""
    median = lambda key: round(statistics.median(r[key] for r in runs), 3)  # noqa: E731
    return {"runs": len(runs), "step_over_bound_min": min(r["step_over_bound"] for r in runs),
            "step_over_bound_median": median("step_over_bound"),
            "step_over_bound_max": max(r["step_over_bound"] for r in runs),
            "within_2x": sum(r["step_over_bound"] <= 2 for r in runs),
            "step_over_bound_during_steps_median": median("step_over_bound_during_steps"),
            "within_2x_during_steps": sum(r["step_over_bound_during_steps"] <= 2 for r in runs),
            "step_ms_median": median("step_ms"), "bound_ms_median": median("bound_ms"),
            "peak_gflop_per_s_median": median("peak_gflop_per_s"),
            "peak_gflop_per_s_during_steps_median": median("peak_gflop_per_s_during_steps"),
            "bytes_gb_per_s_median": median("bytes_gb_per_s"),
            "bytes_gb_per_s_during_steps_median": median("bytes_gb_per_s_during_steps")}


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int_arg(1, 100), default=6)
    p.add_argument("--model", default="smollm2-135m", help="a model name `python -m minibatch profile` takes")
    p.add_argument("--batch", type=int_arg(1, 4096), default=32, help="requests decoded per step")
    p.add_argument("--context-len", type=int_arg(1, 1 << 16), default=256, help="cached tokens of every request")
    p.add_argument("--repeats", type=int_arg(1, 1000), default=10, help="timed steps per run")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--attention-backend", choices=backend_names(), default="cpp")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    args = p.parse_args(argv)
    load_before, runs = machine_load(), []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.runs):
            try:
                runs.append(one_run(args, os.path.join(folder, f"run{i}.json")))
            except ValueError as e:
                raise ValueError(f"run {i + 1}/{args.runs}: {e}") from None
            r = runs[-1]
            print(f"run {i + 1}/{args.runs}: step {r['step_ms']:.1f} ms, bound {r['bound_ms']:.1f} ms ({r['bound']}), "
                  f"{r['step_over_bound']}x ({r['step_over_bound_during_steps']}x at the roofs between steps)")
    command = "python benchmarks/decode_step_runs.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command, "environment": environment(load_before), "runs": runs, "summary": summary(runs)}
    s = result["summary"]
    print(f"median {s['step_over_bound_median']}x its bound, {s['within_2x']} of {s['runs']} within 2x; at the roofs "
          f"between steps median {s['step_over_bound_during_steps_median']}x, {s['within_2x_during_steps']} within 2x")
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
