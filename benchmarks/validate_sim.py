"""Validate the calibrated simulator against measured runs on held-out traces (issue 6).

    python -m minibatch calibrate --model smollm2-135m --threads 1 --draft-model smollm2-135m-draft
    python benchmarks/validate_sim.py --threads 1 --json data/cpu/sim_validation.json

Each trace is a ShareGPT-length Poisson trace made with a seed the calibration never used
(calibration: seed 1234 and synthetic batches). Every policy runs twice on it: measured (the real
model, WallClock) and simulated (no model, the profile's clock); ``minibatch.sim.validate`` reports
the relative error of output throughput and TTFT p50 (acceptance: within 15%, goal 10%).
Use the same --threads as the calibration: the profile is only valid for the setting it measured.
"""

from __future__ import annotations

import argparse
import sys
import time

from minibatch.compare import CompareConfig, build_trace, environment, load_draft_runner, load_runner, write_json
from minibatch.sim.cost_model import Profile
from minibatch.sim.validate import validate_policy

# name -> CompareConfig overrides; the defaults are the main job's (32 requests, 4 req/s, seed 0)
TRACES = {
    "default-rate4-seed0": dict(num_requests=32, rate=4.0, seed=0),
    "rate8-seed1": dict(num_requests=32, rate=8.0, seed=1),
    "long-prompts-rate1-seed2": dict(num_requests=20, rate=1.0, seed=2, long_prompts=2, long_prompt_len=768),
}
POLICIES = ("static", "orca", "paged", "prefill_first", "chunked", "spec_ngram", "spec")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", default=None, help="default data/profiles/<model>-cpu.json")
    p.add_argument("--traces", default=",".join(list(TRACES)[:2]), help=f"comma-separated subset of {','.join(TRACES)}")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=128, help="chunked policy's token budget")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    profile_path = args.profile or f"data/profiles/{args.model}-cpu.json"
    profile = Profile.load(profile_path)
    model, tokenizer, runner, _ = load_runner(args.model, threads=args.threads)
    policies = [x for x in args.policies.split(",") if x]
    draft_runner = None
    if "spec" in policies:
        draft_runner = load_draft_runner("smollm2-135m-draft" if args.model == "smollm2-135m" else args.model,
                                         args.model, model, tokenizer)
    from minibatch.compare import _warm_up

    _warm_up(runner, draft_runner)
    result = {"command": "python " + " ".join(sys.argv), "environment": environment(), "profile": profile_path,
              "profile_command": profile.meta.get("command"), "model": args.model, "traces": {}}
    for name in args.traces.split(","):
        cfg = CompareConfig(model=args.model, policies=tuple(policies), check_reference=False, figures_dir=None,
                            progress=False, max_num_batched_tokens=args.max_num_batched_tokens, **TRACES[name])
        requests = build_trace(cfg, tokenizer, model.config.vocab_size)
        rows = []
        for policy in policies:
            t = time.perf_counter()
            row = validate_policy(policy, cfg, runner, requests, profile, draft_runner)
            row["run_time_s"] = round(time.perf_counter() - t, 1)
            rows.append(row)
            e = row["error"]
            print(f"{name:<26} {policy:<14} out tok/s {row['measured']['output_throughput_tok_s']:7.2f} "
                  f"sim {row['simulated']['output_throughput_tok_s']:7.2f} ({e['output_throughput_tok_s']:+.1%})  "
                  f"TTFT p50 {row['measured']['ttft_p50_s']:6.3f} s sim {row['simulated']['ttft_p50_s']:6.3f} "
                  f"({e['ttft_p50_s']:+.1%})  replay {row['replay_error'] if row['replay_error'] is None else format(row['replay_error'], '+.1%')}",
                  flush=True)
        result["traces"][name] = {"config": TRACES[name], "num_requests": len(requests), "policies": rows}
    errs = [abs(r["error"][m]) for t in result["traces"].values() for r in t["policies"]
            for m in ("output_throughput_tok_s", "ttft_p50_s")]
    result["max_abs_error"] = max(errs)
    result["mean_abs_error"] = sum(errs) / len(errs)
    print(f"|error| of output throughput and TTFT p50: mean {result['mean_abs_error']:.1%}, max {result['max_abs_error']:.1%}")
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
