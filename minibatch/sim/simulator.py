"""The simulator: the real schedulers on a calibrated clock, with no model at all.

    python -m minibatch simulate --profile data/profiles/smollm2-135m-cpu.json --num-requests 2000 --rate 8

Vidur's idea (Agrawal et al., MLSys'24), with one difference: the very objects that schedule the
real engine (``make_engine``'s schedulers, block manager, preemption, queue policies) run here;
only the executor (:class:`~minibatch.runner.model_runner.SimExecutor`: made-up tokens, output
lengths from the trace because requests ignore EOS) and the clock (:class:`SimClock` on a
calibrated :class:`~minibatch.sim.cost_model.Profile`) are replaced. So a simulated schedule is
step for step the schedule the real engine makes, and only the step times are predicted.
"""

from __future__ import annotations

import time

from minibatch.request import Request
from minibatch.sim.clock import SimClock
from minibatch.sim.cost_model import Profile


def sim_executor(policy: str, acceptance_rate=None, seed: int = 0, proposal_rate: float = 1.0):
    """A fresh SimExecutor for ``policy``: spec policies accept drafts with ``acceptance_rate``
    (a float, or per-position rates); only ``spec`` (a draft model) pays draft forwards;
    ``spec_ngram`` finds drafts for a row with probability ``proposal_rate``."""
    from minibatch.policies import SPEC_POLICIES
    from minibatch.runner.model_runner import SimExecutor

    if policy in SPEC_POLICIES and acceptance_rate is None:
        raise ValueError(f"policy {policy!r} in simulation needs an acceptance rate (--acceptance-rate)")
    return SimExecutor(acceptance_rate=acceptance_rate if policy in SPEC_POLICIES else None, seed=seed,
                       draft_forwards=policy == "spec", proposal_rate=proposal_rate if policy == "spec_ngram" else 1.0,
                       draft_catch_up=True)


def simulate_policy(policy: str, cfg, profile: Profile, requests: list[Request], acceptance_rate=None,
                    proposal_rate: float = 1.0):
    """Run fresh copies of ``requests`` under ``policy`` on the simulated clock; returns
    (requests, engine). ``cfg`` is a CompareConfig (batch sizes, KV slots, budgets ...)."""
    from minibatch.compare import run_policy

    return run_policy(policy, cfg, sim_executor(policy, acceptance_rate, cfg.seed, proposal_rate), None, requests,
                      clock=SimClock(profile, profile))


def run_simulation(cfg, profile_path: str, acceptance_rate=None) -> dict:
    """``python -m minibatch simulate``: the trace of ``cfg`` (a CompareConfig) through each of
    its policies (our engine's only: the HF baselines need the model) on the clock calibrated in
    ``profile_path``. Prints the table; returns (and with cfg.json_path writes) the results.

    Raises:
        ValueError: a policy that needs a model (hf_generate, hf_generate_batch); a spec policy
            without acceptance_rate.
    """
    from minibatch.compare import build_trace, environment, kv_slots, policy_entry, print_table, write_json
    from minibatch.metrics import SLO, summarize
    from minibatch.policies import ENGINE_POLICIES

    outside = [p for p in cfg.policies if p not in ENGINE_POLICIES]
    if outside:
        raise ValueError(f"--policies: simulate runs our engine's policies only ({','.join(ENGINE_POLICIES)}); "
                         f"{','.join(outside)} need the real model: use compare")
    profile = Profile.load(profile_path)
    requests = build_trace(cfg, None, profile.vocab_size)
    print(f"profile {profile_path}: {profile.model}, calibrated by {profile.meta.get('command')!r}")
    print(f"trace: {len(requests)} requests, {sum(r.num_prompt_tokens for r in requests)} prompt + "
          f"{sum(r.max_new_tokens for r in requests)} output tokens, arrivals over {requests[-1].arrival_time_s:.1f} s")
    result = {"command": cfg.command, "environment": environment(), "profile": str(profile_path),
              "model": profile.model, "num_requests": len(requests), "clock": "sim", "rate": cfg.rate,
              "batch_size": cfg.batch_size, "max_bs": cfg.max_bs, "n_slots": kv_slots(cfg, requests),
              "acceptance_rate": acceptance_rate, "seed": cfg.seed, "policies": {}}
    for policy in cfg.policies:
        t = time.perf_counter()
        reqs, engine = simulate_policy(policy, cfg, profile, requests, acceptance_rate)
        summary = summarize(reqs, engine.trace, SLO(ttft_s=cfg.slo_ttft_s, tpot_s=cfg.slo_tpot_s))
        entry = policy_entry(policy, summary, engine, cfg, reqs)
        entry["run_time_s"] = round(time.perf_counter() - t, 3)  # the simulator's own wall time
        result["policies"][policy] = entry
    print_table(result)
    write_json(result, cfg.json_path)
    return result
