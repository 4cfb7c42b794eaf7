"""Scale experiments in simulation: thousands of ShareGPT-length requests, no model.

    python benchmarks/sim_scale.py --json data/sim/scale.json

Two clocks, each stated in the output:

* ``cpu``: the calibrated profile of smollm2-135m on this CPU (data/profiles/smollm2-135m-cpu.json,
  measured by ``python -m minibatch calibrate``); the CPU-sized trace (outputs x 0.25, prompts
  <= 256 tokens, as the main job); at most 32 requests per step, 8192 KV token slots;
* ``h100-roofline``: an ANALYTICAL roofline of a 7B Llama-shaped model in bf16 on an H100
  (``experiments.rate_sweep.roofline_profile``; not measured: a what-if for the shape of a GPU's
  cost, where a decode step's time hardly grows with the batch); full ShareGPT lengths; at most
  256 requests per step, 120k KV token slots (what an 80 GB H100 holds next to the weights).

For each: a request-rate sweep (static batching bs 8/32/64 vs orca with the trace's true output
length reserved (its best case) and with the maximum reserved (as published), paged, chunked), the offline
table (every request at t = 0: the often-quoted table), and the capacity at a latency bound (the
Orca / vLLM "x times the throughput at the same latency" claims).
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import time

from minibatch.checks import MAX_NUM_REQUESTS, OneLineParser, comma_list, int_arg, output_file_arg
from minibatch.experiments import rate_sweep
from minibatch.lessons.benchmarks import CLAIM_IDS
from minibatch.report import environment, machine_load, write_json
from minibatch.sim.cost_model import Profile
from minibatch.workload import make_trace

# Llama-2-7B's shape: 32 layers, hidden 4096, 32 KV heads x 128 dims, K and V in bf16 (0.5 MB per token);
# an 80 GB H100 holds ~120k tokens of KV next to the 13.4 GB of weights.
LLAMA7B = dict(num_params=6.7e9, num_layers=32, hidden_size=4096, kv_bytes_per_token=2 * 32 * 4096 * 2)

SETTINGS = {
    "cpu": dict(trace=dict(max_prompt_len=256, max_output_len=256, output_scale=0.25),
                engine=dict(max_num_seqs=32, n_slots=8192),
                rates=(0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9, 1.0), latency_limit_s=1.0),
    "h100-roofline": dict(trace=dict(max_prompt_len=1024, max_output_len=1024, output_scale=1.0),
                          engine=dict(max_num_seqs=256, n_slots=120_000), rates=(2, 5, 7.5, 10, 15, 20, 30, 40),
                          latency_limit_s=0.1),
}


ROOT = Path(__file__).resolve().parents[1]  # the default profile is found from any working directory


def profile_for(name: str, cpu_profile: str) -> Profile:
    if name == "cpu":
        return Profile.load(cpu_profile)
    return rate_sweep.roofline_profile("llama-7b (H100 roofline, analytical)", **LLAMA7B)


def run(name: str, num_requests: int, cpu_profile: str, seed: int = 0, rates=None) -> dict:
    s = SETTINGS[name]
    profile = profile_for(name, cpu_profile)
    rates = rates or s["rates"]
    t = time.perf_counter()

    def trace(rate):
        return make_trace(num_requests, rate_per_s=rate, seed=seed, **s["trace"])

    # Orca as published reserves prompt + the server's max length per request ("Orca (Max)", vLLM §6.1)
    orca_max = ("orca", dict(reserve_new_tokens=s["trace"]["max_output_len"]))
    setups = {**rate_sweep.DEFAULT_SETUPS, "orca (max)": orca_max}
    sweep = rate_sweep.rate_sweep(profile, trace, rates, setups, **s["engine"])
    offline = rate_sweep.offline_table(profile, trace(1.0), setups, **s["engine"])
    limit = s["latency_limit_s"]
    capacity = {setup: rate_sweep.capacity_at(sweep, setup, "normalized_latency_s", limit) for setup in setups}
    lower_bounds = [setup for setup in setups if rate_sweep.capacity_is_lower_bound(sweep, setup, limit=limit)]
    return {"clock": name, "profile": profile.model, "profile_meta": {k: v for k, v in profile.meta.items()
                                                                      if k in ("command", "analytical", "assumptions")},
            "num_requests": num_requests, "seed": seed, "trace": s["trace"], "engine": s["engine"],
            "latency_limit_normalized_s": limit, "rate_sweep": sweep, "offline": offline, "capacity": capacity,
            "capacity_lower_bounds": lower_bounds, "sim_time_s": round(time.perf_counter() - t, 1)}


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int_arg(1, MAX_NUM_REQUESTS), default=1000)
    p.add_argument("--profile", default=str(ROOT / "data/profiles/smollm2-135m-cpu.json"),
                   help="the cpu setting's profile (default: data/profiles/smollm2-135m-cpu.json)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {','.join(SETTINGS)}")
    p.add_argument("--json", type=output_file_arg, default=None)
    args = p.parse_args(argv)
    settings = comma_list(args.settings, "--settings")  # ValueError: one line (run_script)
    unknown = [x for x in settings if x not in SETTINGS] or ([] if settings else [""])
    if unknown:  # now, not after the settings before it were simulated
        p.error(f"--settings must be a comma-separated subset of {','.join(SETTINGS)}, got {unknown[0]!r}")
    if "cpu" in settings and not Path(args.profile).is_file():
        p.error(f"--profile: no such file {args.profile!r} (make one with python -m minibatch calibrate)")
    load_before = machine_load()  # how busy the machine was: recorded with the result
    result = {"command": "python " + " ".join(sys.argv), "environment": environment(), "claims": list(CLAIM_IDS),
              "settings": {}}
    for name in settings:
        r = run(name, args.num_requests, args.profile)
        result["settings"][name] = r
        print(f"== {name} ({r['profile']}; {r['num_requests']} requests; simulated in {r['sim_time_s']} s)")
        for row in r["offline"]:
            print(f"  offline {row['setup']:<13} {row['request_throughput_req_s']:8.3f} req/s "
                  f"{row['output_throughput_tok_s']:9.1f} tok/s  mean batch {row['mean_batch_size']:.1f}")
        shown = {k: (f">= {v}" if k in r["capacity_lower_bounds"] else v) for k, v in r["capacity"].items()}
        print(f"  capacity at normalized latency <= {r['latency_limit_normalized_s']} s/token: {shown}"
              + (" ('>=': under the bound at every swept rate)" if r["capacity_lower_bounds"] else ""))
    result["environment"] = environment(load_before)
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
