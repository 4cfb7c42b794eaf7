"""Client-side serving benchmark: bench-serve against our server under several policies and against
``transformers serve`` (continuous batching) on the same model directory, at several request rates.

    python benchmarks/serving.py --json data/cpu/serving.json

Every server is a child process on 127.0.0.1 (started, measured at each rate, stopped) with
``--threads`` torch threads. The same ShareGPT requests (seeded) go to every server, greedy, with
max_tokens from the ShareGPT reply (clipped to --max-output-len), stopping at EOS: ``transformers
serve`` does not know vLLM's ignore_eos, so neither side uses it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from minibatch.files import write_json
from minibatch.report import environment
from minibatch.serving.bench import bench, load_tokenizer, sample_requests
from minibatch.serving.launch import ServerProcess

SUMMARY_KEYS = ("completed", "failed", "request_throughput", "output_throughput", "ttft_p50_s", "ttft_p99_s",
                "tpot_p50_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s")


def servers(args) -> dict[str, dict]:
    """name -> {"args": our serve options} or {"command": another server's command line}."""
    ours = ["--model", args.model, "--threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs),
            "--n-slots", str(args.n_slots), "--dtype", args.dtype]
    out = {p: {"args": ours + ["--policy", p]} for p in args.policies.split(",")}
    if args.transformers_serve:
        from minibatch.hf_load import cache_dir

        folder = cache_dir() / "smollm2-135m-instruct"  # the offline SmolLM2, converted by load_model
        exe = shutil.which("transformers")
        if exe and folder.exists():
            out["transformers_serve_cb"] = {"command": [
                exe, "serve", str(folder), "--continuous-batching", "--device", "cpu", "--dtype", args.dtype,
                "--host", "127.0.0.1", "--port", "{port}"], "model": str(folder)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policies", default="static,paged,chunked")
    p.add_argument("--rates", default="0.5,1,2", help="request rates, req/s (Poisson)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--n-slots", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both servers' dtype")
    p.add_argument("--no-transformers-serve", dest="transformers_serve", action="store_false")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    requests = sample_requests(args.num_prompts, 0, load_tokenizer(args.model), args.max_prompt_len,
                               args.max_output_len)
    result = {"command": " ".join(["python"] + sys.argv), "environment": environment(), "config": vars(args),
              "runs": []}
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the child servers' thread pools
    logs = tempfile.mkdtemp(prefix="serving-bench-")
    for name, server in servers(args).items():
        log = os.path.join(logs, f"{name}.log")
        with ServerProcess(server.get("args", []), log, command=server.get("command")) as srv:
            model = server.get("model", args.model)
            bench(srv.base_url, model, requests[:2], progress=False)  # warm-up, not measured
            for rate in rates:
                out = bench(srv.base_url, model, requests, rate=rate, seed=0, progress=False)
                s = out["summary"]
                result["runs"].append({"server": name, "rate": rate, "summary": s})
                print(f"{name:24s} rate {rate:4.1f}/s  " + "  ".join(
                    f"{k}={s[k]:.3f}" if isinstance(s[k], float) else f"{k}={s[k]}" for k in SUMMARY_KEYS),
                    flush=True)
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
