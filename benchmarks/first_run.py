"""How long the main job takes on a fresh machine: ``python -m minibatch compare`` with empty caches.

    python benchmarks/first_run.py --json data/cpu/first_run.json [-- extra compare options]

Runs the default ``compare`` once in a subprocess whose model cache (``MINIBATCH_CACHE``: the converted model and
the reference outputs) and torch extension cache (``TORCH_EXTENSIONS_DIR``: the C++ kernels) are new empty
folders, so it pays everything a first run pays: the model's conversion, the kernel builds, the HF reference
outputs, the policies. Reports the wall-clock total and its parts as compare prints them (the model load with its
conversion, the reference) and records them (each policy's ``run_time_s``). The package itself is already
installed. Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from minibatch.__main__ import build_parser, load_plugins
from minibatch.checks import OneLineParser, given_options, output_file_arg
from minibatch.config import opt
from minibatch.report import environment, machine_load, write_json

ROW_FIELDS = ("output_throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "e2e_p50_s", "goodput_req_s")


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    p.add_argument("compare_args", nargs="*", help="extra options for compare (after --)")
    args = p.parse_args(argv)
    said = io.StringIO()  # compare's own options (a --policy-module's too), checked now, not after a subprocess
    try:
        with contextlib.redirect_stderr(said):
            load_plugins(["compare", *args.compare_args])
            compare = build_parser()
            given = given_options(compare, compare.parse_args(["compare", *args.compare_args]),
                                  ("json_path", "figures_dir"), ("compare",))
    except SystemExit as e:
        if e.code in (0, None):  # -- --help: compare's help was printed
            raise
        p.error(f"compare option: {said.getvalue().strip().partition(': error: ')[2]}")
    except ValueError as e:  # a bad --policy-module file
        p.error(f"compare option: {e}")
    if given:
        p.error(f"{opt(given[0])} is set by this script (compare writes into a temporary folder)")
    load_before = machine_load()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compare.json"
        env = os.environ | {"MINIBATCH_CACHE": str(Path(tmp) / "cache"),
                            "TORCH_EXTENSIONS_DIR": str(Path(tmp) / "extensions")}
        cmd = [sys.executable, "-m", "minibatch", "compare", "--no-progress", "--figures-dir", str(Path(tmp) / "fig"),
               "--json", str(out), *args.compare_args]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        total = time.perf_counter() - t0
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [""])[-1]
            raise ValueError(f"compare failed (exit {proc.returncode}): {last}")
        result = json.loads(out.read_text())

    def seconds(pattern: str) -> float | None:
        m = re.search(pattern, proc.stdout)
        return float(m.group(1)) if m else None

    policies = {p: row["run_time_s"] for p, row in result["policies"].items()}
    parts = {"model_load_s": seconds(r"loaded in ([\d.]+) s"), "reference_s": seconds(r"alone, ([\d.]+) s"),
             "policies_s": round(sum(policies.values()), 1)}
    parts["rest_s"] = round(total - sum(v for v in parts.values() if v is not None), 1)  # import, builds, figures
    print(f"first run: {total:.1f} s; " + ", ".join(f"{k} {v}" for k, v in parts.items()))
    summary = {"command": "python benchmarks/first_run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "environment": environment(load_before), "total_s": round(total, 1), "parts": parts,
               "policy_run_time_s": policies, "dtype": result["config"]["dtype"],
               "matches_reference": {p: row.get("matches_reference") for p, row in result["policies"].items()},
               "num_requests": result["num_requests"], "num_output_tokens": result["num_output_tokens"],
               "policy_rows": {p: {k: row[k] for k in ROW_FIELDS} for p, row in result["policies"].items()},
               "contended": result["contended"]}
    write_json(summary, args.json_path)
    return summary


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
