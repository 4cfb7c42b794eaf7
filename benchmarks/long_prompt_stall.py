"""How long does one long prompt stop the other requests' streams? Under each ``--configs`` entry (policy and
attention backend) a server runs in a child process; a stream of ``--stream-tokens`` tokens is under way when a
``--prompt-len``-token prompt arrives; we record the longest gap between the stream's tokens (its worst ITL) and
the long request's time to its one token.

    python benchmarks/long_prompt_stall.py --json data/cpu/long_prompt_stall.json

Without a token budget (``paged``) the long prompt's whole prefill is one step, and every running decode waits
for it: the stall Sarathi-Serve names "generation stalls" (Agrawal et al., OSDI'24, §3.2). Chunked prefill
(``chunked``, a budget of ``max_num_batched_tokens`` tokens per step, decodes first) cuts it into steps of at most
that many tokens, so a running stream waits for one chunk at a time (§4.1-4.2). Each configuration runs
``--trials`` times; the server sends one warm-up request first.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from minibatch.checks import OneLineParser, int_arg, output_file_arg, run_script
from minibatch.precision import dtype_name, resolve_dtype
from minibatch.report import environment, machine_load, write_json
from minibatch.serving.background import ServerProcess

STREAM_PROMPT = "Once upon a time"


def stream_gaps(base_url: str, max_tokens: int, started: threading.Event, out: list) -> None:
    """Stream one completion of ``max_tokens`` tokens; append the times (perf_counter s) its chunks arrive (a
    token whose text is not yet whole arrives with the next one)."""
    body = {"prompt": STREAM_PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.perf_counter())
                if len(out) == 5:
                    started.set()


def one_trial(base_url: str, prompt_len: int, stream_tokens: int) -> dict:
    """One stream, and the long prompt sent once the stream has its 5th token. Returns seconds: the stream's
    longest gap while the long request ran, its median gap before it, the long request's latency (one token).
    Raises RuntimeError if a request fails."""
    times: list[float] = []
    started = threading.Event()
    streamer = threading.Thread(target=stream_gaps, args=(base_url, stream_tokens, started, times))
    streamer.start()
    if not started.wait(300):
        raise RuntimeError("the stream did not start within 300 s")
    before = [b - a for a, b in zip(times, times[1:])]
    long_prompt = [3 + (i * 7) % 256 for i in range(prompt_len)]  # token ids any vocabulary has, no two alike in a row
    t0 = time.perf_counter()
    r = httpx.post(base_url + "/completions", json={"prompt": long_prompt, "max_tokens": 1}, timeout=600)
    t1 = time.perf_counter()
    streamer.join()
    if r.status_code != 200:
        raise RuntimeError(f"the long prompt got HTTP {r.status_code}: {r.text[:200]}")
    if times[-1] < t1:  # the stream ended first: its gaps would not show the stall
        raise RuntimeError("the stream ended before the long prompt's answer; give more --stream-tokens")
    during = [b - a for a, b in zip(times, times[1:]) if b > t0 and a < t1]
    return {"long_request_s": round(t1 - t0, 3), "max_gap_s": round(max(during, default=0.0), 3),
            "median_gap_before_s": round(statistics.median(before), 4)}


def measure(policy: str, backend: str, args, tmp: str) -> dict:
    """All trials of one configuration (policy, attention backend), each in the same server process."""
    server_args = ["--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads), "--policy", policy,
                   "--attention-backend", backend, "--max-num-seqs", "8"]
    with ServerProcess(server_args, str(Path(tmp) / f"{policy}_{backend}.log"), start_timeout_s=600) as server:
        httpx.post(server.base_url + "/completions", json={"prompt": STREAM_PROMPT, "max_tokens": 2}, timeout=300)
        trials = [one_trial(server.base_url, args.prompt_len, args.stream_tokens) for _ in range(args.trials)]
    row = {"policy": policy, "attention_backend": backend, "trials": trials,
           "max_gap_s": max(t["max_gap_s"] for t in trials),
           "long_request_s": statistics.median(t["long_request_s"] for t in trials),
           "median_gap_before_s": statistics.median(t["median_gap_before_s"] for t in trials)}
    print(f"{policy:>8} {backend:>5}: worst gap {row['max_gap_s']:.2f} s (median ITL before "
          f"{row['median_gap_before_s'] * 1e3:.0f} ms); the {args.prompt_len}-token prompt's one token after "
          f"{row['long_request_s']:.2f} s", flush=True)
    return row


def configs_arg(text: str) -> list[tuple[str, str]]:
    """An argparse ``type``: comma-separated ``policy:backend`` pairs of engine policies and attention backends, as
    (policy, backend) tuples."""
    from minibatch.policies import POLICIES
    from minibatch.runner.backends import backend_names

    configs = [(c, *c.partition(":")[::2]) for c in text.split(",")]
    for c, policy, backend in configs:
        if policy not in POLICIES or backend not in backend_names():
            raise argparse.ArgumentTypeError(f"must be comma-separated POLICY:BACKEND pairs (policies: "
                                             f"{', '.join(POLICIES)}; backends: {', '.join(backend_names())}), "
                                             f"got {c!r}")
    return [(policy, backend) for _, policy, backend in configs]


def main() -> None:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="served model (default: smollm2-135m)")
    p.add_argument("--dtype", default="auto", help="the server's --dtype (default: auto)")
    p.add_argument("--configs", type=configs_arg, default="paged:torch,paged:sdpa,chunked:torch,chunked:sdpa",
                   help="comma-separated POLICY:BACKEND pairs (default: paged and chunked, torch and sdpa)")
    p.add_argument("--prompt-len", type=int_arg(1, 100_000), default=2000, help="the long prompt's tokens "
                   "(default: 2000)")
    p.add_argument("--stream-tokens", type=int_arg(10, 100_000), default=200, help="the stream's output tokens "
                   "(default: 200)")
    p.add_argument("--trials", type=int_arg(1, 100), default=2, help="trials per configuration (default: 2)")
    p.add_argument("--threads", type=int_arg(1, 1024), default=2, help="the server's torch threads (default: 2)")
    p.add_argument("--json", type=output_file_arg, default=None, help="write the result here")
    args = p.parse_args()
    load_before = machine_load()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(policy, backend, args, tmp) for policy, backend in args.configs]
    result = {"command": "python benchmarks/long_prompt_stall.py " + " ".join(
        f"--{k.replace('_', '-')} {','.join(map(':'.join, v)) if k == 'configs' else v}" for k, v in vars(args).items()
        if v is not None),
        "environment": environment(load_before), "model": args.model, "prompt_len": args.prompt_len,
        "dtype": dtype_name(resolve_dtype(args.dtype, "cpu")),
        "stream_tokens": args.stream_tokens, "configs": rows}
    write_json(result, args.json)


if __name__ == "__main__":
    run_script(main)
