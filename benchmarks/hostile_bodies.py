"""Can a few huge bad request bodies delay everyone else's requests? A normal completion's latency alone and while
``--bodies`` huge bodies (each refused with 400) are in flight, against our server in a child process.

    python benchmarks/hostile_bodies.py --json data/cpu/hostile_bodies.json

Kinds of body (each several MB): ``ids``: a prompt of a million token ids (past any context); ``batch``: a batch of
a million prompts (one prompt per request is supported); ``stop``: a million stop strings (16 allowed);
``stop_ids``: a million stop token ids (1024 allowed); ``unknown``: an unknown field of a million lists. For each
kind, ``--trials`` times: ``--bodies`` huge bodies are sent at once, 0.15 s later the normal request (3 prompt
tokens, 2 output tokens); its latency is recorded. The client runs in this process, its sends in threads; the
server (``--threads`` torch threads) in another.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from minibatch.checks import OneLineParser, int_arg, output_file_arg, run_script
from minibatch.report import environment, machine_load, write_json
from minibatch.serving.background import ServerProcess

ITEMS = 1_000_000
KINDS = {"ids": {"prompt": list(range(ITEMS)), "max_tokens": 4},
         "batch": {"prompt": ["ab"] * ITEMS, "max_tokens": 4},
         "stop": {"prompt": "hi", "max_tokens": 4, "stop": ["x"] * ITEMS},
         "stop_ids": {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [7] * ITEMS},
         "unknown": {"prompt": "hi", "max_tokens": 4, "zzz": [[1]] * ITEMS}}
NORMAL = {"prompt": [1, 2, 3], "max_tokens": 2}


def post(client: httpx.Client, body: bytes, out: list | None = None) -> tuple[int, float]:
    """(HTTP status, seconds) of one POST /completions."""
    t = time.perf_counter()
    status = client.post("/completions", content=body, headers={"Content-Type": "application/json"}).status_code
    result = (status, time.perf_counter() - t)
    if out is not None:
        out.append(result)
    return result


def measure(base_url: str, bodies: int, trials: int) -> dict:
    """Per kind: the normal request's latency alone (median of 5) and under load (each trial), the bad bodies'
    statuses. Raises RuntimeError if the normal request fails."""
    normal = json.dumps(NORMAL).encode()
    out = {}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for _ in range(3):  # warm-up
            post(client, normal)
        for kind, body in KINDS.items():
            data = json.dumps(body).encode()
            alone = [post(client, normal)[1] for _ in range(5)]
            loaded, statuses = [], set()
            for _ in range(trials):
                results: list = []
                threads = [threading.Thread(target=post, args=(client, data, results)) for _ in range(bodies)]
                for t in threads:
                    t.start()
                time.sleep(0.15)
                status, seconds = post(client, normal)
                if status != 200:
                    raise RuntimeError(f"the normal request got HTTP {status} while {kind} bodies were in flight")
                loaded.append(round(seconds * 1e3, 1))
                for t in threads:
                    t.join()
                statuses |= {s for s, _ in results}
            out[kind] = {"body_bytes": len(data), "alone_ms": round(statistics.median(alone) * 1e3, 1),
                         "with_bodies_ms": loaded, "with_bodies_median_ms": statistics.median(loaded),
                         "bad_body_statuses": sorted(statuses)}
            print(f"{kind:>6}: {len(data) / 1e6:.1f} MB bodies x {bodies}: the normal request {out[kind]['alone_ms']} "
                  f"ms alone, {loaded} ms with them in flight (they got {sorted(statuses)})")
    return out


def main() -> None:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-random-llama", help="served model (default: tiny-random-llama)")
    p.add_argument("--bodies", type=int_arg(1, 64), default=5, help="huge bodies in flight at once (default: 5)")
    p.add_argument("--trials", type=int_arg(1, 100), default=3, help="trials per kind (default: 3)")
    p.add_argument("--threads", type=int_arg(1, 1024), default=1, help="the server's torch threads (default: 1)")
    p.add_argument("--json", type=output_file_arg, default=None, help="write the result here")
    args = p.parse_args()
    load_before = machine_load()
    with tempfile.TemporaryDirectory() as tmp, ServerProcess(
            ["--model", args.model, "--dtype", "float32", "--threads", str(args.threads)],
            str(Path(tmp) / "server.log")) as server:
        kinds = measure(server.base_url, args.bodies, args.trials)
    result = {"command": "python benchmarks/hostile_bodies.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "environment": environment(load_before), "model": args.model, "bodies": args.bodies, "kinds": kinds}
    write_json(result, args.json)


if __name__ == "__main__":
    run_script(main)
