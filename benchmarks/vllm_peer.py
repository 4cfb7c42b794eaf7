"""Our engine against vLLM and transformers' continuous batching on one saturated trace, on this machine.

    python benchmarks/vllm_peer.py --vllm-python .venv-vllm/bin/python --json data/cpu/vllm_peer.json

The trace: 64 ShareGPT requests all arriving at t = 0 (``--arrival zero``), output lengths x 0.5, greedy with
ignore_eos, bf16 (``--dtype float32`` on CPUs without native bf16), max_num_seqs 32, 2 GiB of KV for every engine,
token budget 4096 (vLLM's CPU default; it applies to our chunked policy and to vLLM). Two rounds of ``python -m
minibatch compare`` (run in-process), each running our policy and then vLLM, so each engine is timed twice,
alternating (a machine that slows down between runs lowers one round, not one engine); transformers'
``generate_batch`` runs last in each round. Every run's outputs are checked against HF generate (bf16: the
logprob-close rule; float32: exact). The summary reports, per round, our output throughput over vLLM's and over
transformers', and the lower of the rounds. A quick look at the setup, whose ratios are not the published ones:
``--num-requests 8 --rounds 1`` (a few minutes rather than a quarter of an hour on 2 cores).

Run nothing else meanwhile: each round records the machine's load before and after, and compare warns when the
machine was contended.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from minibatch.checks import MAX_NUM_REQUESTS, OneLineParser, int_arg, output_file_arg
from minibatch.__main__ import main as minibatch_main
from minibatch.report import write_json

TRACE = ["--arrival", "zero", "--output-scale", "0.5", "--seed", "1", "--max-num-seqs", "32",
         "--kv-cache-memory-bytes", str(2 * 2**30), "--max-num-batched-tokens", "4096"]


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="the interpreter of an environment with vllm installed")
    p.add_argument("--policy", default="chunked", help="our policy (default: chunked)")
    p.add_argument("--attention-backend", default="sdpa", help="our attention backend (default: sdpa)")
    p.add_argument("--rounds", type=int_arg(1, 20), default=2, help="rounds of (ours, vLLM)")
    p.add_argument("--num-requests", type=int_arg(1, MAX_NUM_REQUESTS), default=64,
                   help="requests in the trace (default: 64, the issue's trace; fewer for a quick look, whose ratios "
                   "are not the published ones: a short run is dominated by its ramp-up and tail)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="every engine's dtype (default: bfloat16, the issue's trace; float32 on CPUs without native "
                   "bf16, where bf16 is emulated; checked by the exact rule)")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None, help="write the results here")
    args = p.parse_args(argv)
    args.command = " ".join(["python benchmarks/vllm_peer.py"] + (argv if argv is not None else sys.argv[1:]))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    peer = ["--vllm-python", args.vllm_python] if args.vllm_python else []
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            policies = [args.policy, "vllm", "hf_generate_batch"]
            out = Path(tmp) / f"round{i}.json"
            minibatch_main(["compare", "--num-requests", str(args.num_requests), *TRACE, "--dtype", args.dtype,
                            "--policies", ",".join(policies), "--attention-backend", args.attention_backend, *peer,
                            "--no-progress", "--figures-dir", "", "--json", str(out)])
            rounds.append(json.loads(out.read_text()))
    summary = {"policy": args.policy, "attention_backend": args.attention_backend, "dtype": args.dtype,
               "num_requests": args.num_requests, "rounds": []}
    for r in rounds:
        rows = r["policies"]
        ours = rows[args.policy]["output_throughput_tok_s"]
        line = {"ours_tok_s": ours, "contended": r["contended"],
                "matches_reference": {p: row.get("matches_reference") for p, row in rows.items()}}
        for peer_name in ("vllm", "hf_generate_batch"):
            if peer_name in rows:
                line[f"{peer_name}_tok_s"] = rows[peer_name]["output_throughput_tok_s"]
                line[f"ours_over_{peer_name}"] = round(ours / rows[peer_name]["output_throughput_tok_s"], 3)
        summary["rounds"].append(line)
        print(f"{args.policy}: {ours:.1f} tok/s; " + ", ".join(
            f"{k}: {v}" for k, v in line.items() if k.startswith(("vllm", "hf_", "ours_over"))))
    for peer_name in ("vllm", "hf_generate_batch"):
        ratios = [line[f"ours_over_{peer_name}"] for line in summary["rounds"] if f"ours_over_{peer_name}" in line]
        if ratios:
            summary[f"lowest_ours_over_{peer_name}"] = min(ratios)
            print(f"lowest {args.policy} / {peer_name} output throughput: {min(ratios):.2f}x")
    result = {"command": args.command, "summary": summary, "rounds": rounds}
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
