"""Client-side serving benchmark: bench-serve against our server under several policies and against
``transformers serve`` (continuous batching) or ``vllm serve`` on the same model directory, at several request
rates.

    python benchmarks/serving.py --json data/cpu/serving.json
    python benchmarks/serving.py --policies chunked --attention-backend cpp --dtype bfloat16 --ignore-eos \
        --no-transformers-serve --vllm-serve .venv-vllm/bin/python --rates 1,2,4 --json data/cpu/serve_vs_vllm.json

Every server is a child process on 127.0.0.1 (started, measured at each rate, stopped) with
``--threads`` torch threads. The same ShareGPT requests (seeded) go to every server, greedy, with
max_tokens from the ShareGPT reply (clipped to --max-output-len), stopping at EOS: ``transformers
serve`` does not know vLLM's ignore_eos, so neither side uses it. A peer that cannot run here (no
``transformers`` executable, no converted model folder) is listed under "skipped" in the JSON, with why. Peers run
with our servers' C allocator settings (``minibatch.machine.peer_malloc_env``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from minibatch.checks import (MAX_KV_SLOTS, MAX_NUM_REQUESTS, MAX_NUM_SEQS, MAX_RATE, MAX_SECONDS, MAX_TOKENS,
                              MIN_RATE, OneLineParser, comma_list, int_arg, output_file_arg, real_arg, reals_arg)
from minibatch.files import write_json
from minibatch.machine import peer_malloc_env
from minibatch.metrics import SLO
from minibatch.report import environment, machine_load
from minibatch.runner.backends import backend_names
from minibatch.serving.bench import bench, load_tokenizer, sample_requests
from minibatch.serving.background import ServerProcess

SUMMARY_KEYS = ("completed", "failed", "request_throughput_req_s", "output_throughput_tok_s", "ttft_p50_s",
                "ttft_p99_s", "tpot_p50_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "goodput_req_s")
VLLM_PEER = "vllm_serve"


PEER = "transformers_serve_cb"


def servers(args) -> tuple[dict[str, dict], list[dict]]:
    """(name -> {"args": our serve options} or {"command": another server's command line},
    [{"server": name, "skipped": why}] for a peer that cannot run here)."""
    from minibatch.policies import get_policy

    ours = ["--model", args.model, "--threads", str(args.threads), "--dtype", args.dtype, "--attention-backend",
            args.attention_backend]
    # static batching's rows per batch = the others' max_num_seqs; each server gets the settings its policy has
    settings = {"max_num_seqs": args.max_num_seqs, "batch_size": args.max_num_seqs, "n_slots": args.n_slots}
    out = {p: {"args": ours + ["--policy", p] + [x for name, value in settings.items() if name in get_policy(p).options
                                                  for x in ("--" + name.replace("_", "-"), str(value))]}
           for p in comma_list(args.policies, "--policies")}
    skipped = []
    if args.transformers_serve:
        peer, why = transformers_serve(args.model, args.dtype)
        if peer is None:
            skipped.append({"server": PEER, "skipped": why})
        else:
            out[PEER] = peer
    if args.vllm_serve:
        peer, why = vllm_serve(args)
        if peer is None:
            skipped.append({"server": VLLM_PEER, "skipped": why})
        else:
            out[VLLM_PEER] = peer
    return out, skipped


def vllm_serve(args) -> tuple[dict | None, str | None]:
    """``vllm serve`` (from the environment of ``args.vllm_serve``, a Python with vLLM) on the converted SmolLM2
    folder, given what our servers get: dtype, max_num_seqs, the KV cache bytes of --n-slots tokens, prefix
    caching off, its default compiled mode; (its server entry, None) or (None, why it cannot run here)."""
    from pathlib import Path

    from minibatch.gguf import smollm2_cache_path

    exe, folder = Path(args.vllm_serve).parent / "vllm", smollm2_cache_path()
    if not exe.exists():
        return None, f"no vllm executable next to {args.vllm_serve}"
    if args.model != "smollm2-135m" or not folder.exists():
        return None, f"vllm serve runs the converted smollm2-135m folder ({folder}), not --model {args.model}"
    kv_bytes = args.n_slots * 2 * 30 * 3 * 64 * (2 if args.dtype == "bfloat16" else 4)  # SmolLM2: 30 layers, 3 x 64
    return {"command": [str(exe), "serve", str(folder), "--served-model-name", args.model, "--dtype", args.dtype,
                        "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory-bytes", str(kv_bytes),
                        "--max-model-len", "2048", "--no-enable-prefix-caching", "--host", "127.0.0.1",
                        "--port", "{port}"],
            "model": args.model, "env": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"} | peer_malloc_env(),
            "start_timeout_s": 900.0}, None


def transformers_serve(model: str, dtype: str, exe: str | None = None) -> tuple[dict | None, str | None]:
    """``transformers serve --continuous-batching`` on the offline SmolLM2's converted folder:
    (its server entry, None), or (None, why it cannot run here). exe: default ``transformers`` on PATH."""
    from minibatch.gguf import smollm2_cache_path

    folder = smollm2_cache_path()  # written by load_model("smollm2-135m")
    exe = exe or shutil.which("transformers")
    if model != "smollm2-135m":
        return None, f"the peer serves only the converted smollm2-135m folder, not --model {model}"
    if exe is None:
        return None, "no `transformers` executable on PATH (pip install transformers[serving])"
    if not folder.exists():
        return None, f"model folder {folder} is missing (load_model('smollm2-135m') converts it once)"
    return {"command": [exe, "serve", str(folder), "--continuous-batching", "--device", "cpu", "--dtype", dtype,
                        "--host", "127.0.0.1", "--port", "{port}"],
            "model": str(folder), "env": peer_malloc_env()}, None


def policies_arg(text: str) -> str:
    """An argparse ``type``: ``text`` if it lists policies of the engine's table (``minibatch.policies``),
    comma-separated."""
    from minibatch.policies import get_policy

    try:
        for name in comma_list(text, "it") or [""]:
            get_policy(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("it ")) from None
    return text


def rates_arg(text: str) -> str:
    """An argparse ``type``: ``text`` (the JSON's config records it as given) if it lists request rates in
    [MIN_RATE, MAX_RATE] or inf (all at once), comma-separated, as bench-serve takes them."""
    finite = ",".join(x for x in text.split(",") if x.strip().lower() not in ("inf", "infinity"))
    if finite or not text.strip():
        reals_arg(MIN_RATE, MAX_RATE)(finite or text)
    return text


def main() -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policies", type=policies_arg, default="static,paged,chunked")
    p.add_argument("--rates", type=rates_arg, default="0.5,1,2", help="request rates, req/s (Poisson)")
    p.add_argument("--num-prompts", type=int_arg(1, MAX_NUM_REQUESTS), default=32)
    p.add_argument("--max-output-len", type=int_arg(1, MAX_TOKENS), default=64)
    p.add_argument("--max-prompt-len", type=int_arg(1, MAX_TOKENS), default=256)
    p.add_argument("--max-num-seqs", type=int_arg(1, MAX_NUM_SEQS), default=16)
    p.add_argument("--n-slots", type=int_arg(1, MAX_KV_SLOTS), default=8192)
    p.add_argument("--threads", type=int_arg(1, 1024), default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both servers' dtype")
    p.add_argument("--no-transformers-serve", dest="transformers_serve", action="store_false")
    p.add_argument("--vllm-serve", default=None, metavar="PYTHON", help="also run vllm serve from this Python's "
                   "environment (it must hold vLLM)")
    p.add_argument("--attention-backend", choices=backend_names(), default="torch",
                   help="our servers' attention backend")
    p.add_argument("--ignore-eos", action="store_true", help="every request runs to max_tokens (not with "
                   "transformers serve, which does not know it)")
    p.add_argument("--slo-ttft-s", type=real_arg(0, MAX_SECONDS, low_open=True), default=2.0,
                   help="goodput: TTFT objective, s")
    p.add_argument("--slo-tpot-s", type=real_arg(0, MAX_SECONDS, low_open=True), default=0.5,
                   help="goodput: TPOT objective, s")
    p.add_argument("--json", type=output_file_arg, default=None)
    args = p.parse_args()
    load_before = machine_load()  # how busy the machine was: recorded with the result
    rates = [float(x) for x in comma_list(args.rates, "--rates")]
    requests = sample_requests(args.num_prompts, 0, load_tokenizer(args.model), args.max_prompt_len,
                               args.max_output_len)
    to_run, skipped = servers(args)
    result = {"command": " ".join(["python"] + sys.argv), "environment": environment(), "config": vars(args),
              "runs": [], "skipped": skipped}
    for entry in skipped:
        print(f"{entry['server']}: skipped: {entry['skipped']}", flush=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the child servers' thread pools
    logs = tempfile.mkdtemp(prefix="serving-bench-")
    for name, server in to_run.items():
        log = os.path.join(logs, f"{name}.log")
        with ServerProcess(server.get("args", []), log, command=server.get("command"), env=server.get("env"),
                           start_timeout_s=server.get("start_timeout_s", 180.0)) as srv:
            model = server.get("model", args.model)
            bench(srv.base_url, model, requests[:2], progress=False)  # warm-up, not measured
            for rate in rates:
                out = bench(srv.base_url, model, requests, rate=rate, seed=0, progress=False,
                            ignore_eos=args.ignore_eos, slo=SLO(ttft_s=args.slo_ttft_s, tpot_s=args.slo_tpot_s))
                s = out["summary"]
                result["runs"].append({"server": name, "rate": rate, "summary": s})
                print(f"{name:24s} rate {rate:4.1f}/s  " + "  ".join(
                    f"{k}={s[k]:.3f}" if isinstance(s.get(k), float) else f"{k}={s.get(k)}" for k in SUMMARY_KEYS),
                    flush=True)
    if args.json:
        result["environment"] = environment(load_before)
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
