"""Our engine with and without ``machine.keep_freed_memory`` (glibc malloc keeps a step's freed memory for the next
step instead of returning it to the kernel), on vllm_peer.py's saturated trace: 64 ShareGPT requests at t = 0, bf16
(``--dtype float32`` on CPUs without native bf16), max_num_seqs 32, 2 GiB of KV, token budget 4096, our ``chunked``
policy. The setting is process-wide, so each run is a fresh ``python -m minibatch compare`` process, with
``MINIBATCH_KEEP_FREED_MEMORY=0`` (glibc's defaults) or 1, alternating in pairs (a machine that slows down between
runs lowers one pair, not one way).

    python benchmarks/keep_freed_memory.py --json data/cpu/keep_freed_memory.json

Per run: output throughput, TTFT, TPOT, good requests (compare's default SLO), and the process's page faults and
user/system CPU seconds (``getrusage`` of the finished child, model loading included). The summary gives each
pair's ratios, kept over default, and their medians. Outputs are not checked against HF generate here (the allocator
cannot change a number); compare checks them everywhere else.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_peer import TRACE

from minibatch.checks import OneLineParser, int_arg, output_file_arg
from minibatch.policies import POLICIES
from minibatch.report import environment, machine_load, write_json
from minibatch.runner.backends import backend_names

ROW_KEYS = ("output_throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "num_good_requests", "duration_s")


def one_run(keep: bool, args, out: Path) -> dict:
    """One compare process; its summary row and its own resource use."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    code = subprocess.run([sys.executable, "-m", "minibatch", "compare", *TRACE, "--dtype", args.dtype, "--policies",
                           args.policy, "--attention-backend", args.attention_backend, "--no-reference",
                           "--no-progress", "--figures-dir", "", "--json", str(out)], stdout=subprocess.DEVNULL,
                          env=os.environ | {"MINIBATCH_KEEP_FREED_MEMORY": "1" if keep else "0"}).returncode
    if code != 0:  # its one-line error is already on stderr
        raise ValueError(f"the compare run of --policy {args.policy} failed with exit code {code} (its error above)")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(out.read_text())
    row = result["policies"][args.policy]
    return {"malloc": result["environment"]["malloc"], "contended": result["contended"]} | {
        k: row[k] for k in ROW_KEYS} | {
        "page_faults": after.ru_minflt - before.ru_minflt, "user_s": round(after.ru_utime - before.ru_utime, 2),
        "system_s": round(after.ru_stime - before.ru_stime, 2)}


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int_arg(1, 1000), default=4, help="pairs of runs (default, kept)")
    p.add_argument("--policy", choices=tuple(POLICIES), default="chunked")
    p.add_argument("--attention-backend", choices=backend_names(), default="cpp")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    args = p.parse_args(argv)
    command = " ".join(["python benchmarks/keep_freed_memory.py"] + (argv if argv is not None else sys.argv[1:]))
    load_before = machine_load()
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            pair = {way: one_run(way == "kept", args, Path(tmp) / f"{i}_{way}.json") for way in ("default", "kept")}
            pair["kept_over_default"] = {k: round(pair["kept"][k] / pair["default"][k], 3) for k in (
                "output_throughput_tok_s", "ttft_p50_s", "tpot_p50_s", "page_faults", "system_s") if pair["default"][k]}
            pairs.append(pair)
            print(f"pair {i}: " + "; ".join(
                f"{way} {pair[way]['output_throughput_tok_s']:.1f} tok/s, TTFT p50 {pair[way]['ttft_p50_s']:.2f} s, "
                f"{pair[way]['num_good_requests']} good, {pair[way]['page_faults']} faults, "
                f"{pair[way]['system_s']:.1f} s system" for way in ("default", "kept")))
    medians = {k: statistics.median(pair["kept_over_default"][k] for pair in pairs)
               for k in pairs[0]["kept_over_default"]}
    print("median kept / default: " + ", ".join(f"{k} {v:.2f}x" for k, v in medians.items()))
    env = environment(load_before) | {"malloc": "per run: pairs[i][way].malloc"}  # this process runs no engine
    result = {"command": command, "environment": env, "policy": args.policy,
              "attention_backend": args.attention_backend, "dtype": args.dtype, "trace": TRACE, "pairs": pairs,
              "median_kept_over_default": medians}
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
