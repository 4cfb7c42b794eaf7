"""The simulator: the real schedulers on a calibrated clock, with no model at all.

    python -m minibatch simulate --profile data/profiles/smollm2-135m-cpu.json --num-requests 2000 --rate 8

Vidur's idea (Agrawal et al., MLSys'24), with one difference: the very objects that schedule the
real engine (the policy table's schedulers, block manager, preemption, queue policies) run here;
only the executor (:class:`~minibatch.sim.executor.SimExecutor`: made-up tokens, output lengths
from the trace because requests ignore EOS) and the clock (:class:`~minibatch.clock.SimClock` on a
calibrated :class:`~minibatch.sim.cost_model.Profile`) are replaced. So a simulated schedule is
step for step the schedule the real engine makes, and only the step times are predicted.
"""

from __future__ import annotations


from minibatch.clock import SimClock
from minibatch.sim.cost_model import Profile
from minibatch.sim.executor import SimExecutor


def sim_executor(policy: str, acceptance_rate=None, seed: int = 0, proposal_rate: float = 1.0,
                 max_model_len: int | None = None) -> SimExecutor:
    """A fresh SimExecutor for ``policy``: a speculative policy accepts drafts with
    ``acceptance_rate`` (a float, or per-position rates); a draft model's policy pays draft
    forwards; n-gram lookup finds drafts for a row with probability ``proposal_rate``; ``max_model_len``: the
    profiled model's context (None: the SimExecutor's default, no practical limit).

    Raises:
        ValueError: a speculative policy without acceptance_rate.
    """
    from minibatch.policies import get_policy

    proposer = get_policy(policy).proposer
    if proposer and acceptance_rate is None:
        raise ValueError(f"policy {policy!r} in simulation needs an acceptance rate (--acceptance-rate)")
    return SimExecutor(acceptance_rate=acceptance_rate if proposer else None, seed=seed,
                       draft_forwards=proposer == "draft", proposal_rate=proposal_rate if proposer == "ngram" else 1.0,
                       draft_catch_up=True, **({} if max_model_len is None else {"max_model_len": max_model_len}))


def simulate_policies(cfg, profile: Profile, requests, acceptance_rate=None, proposal_rate: float = 1.0) -> dict:
    """Each of cfg.policies (a CompareConfig) on fresh copies of ``requests`` on the simulated
    clock; returns policy -> :class:`~minibatch.experiment.Run`."""
    from minibatch.compare import run_policies

    runs = {}
    for policy in cfg.policies:
        ex = sim_executor(policy, acceptance_rate, cfg.seed, proposal_rate, profile.max_model_len)
        runs |= run_policies(cfg, requests, ex, lambda: SimClock(profile, profile), policies=(policy,))
    return runs


def profile_trace(cfg, profile) -> list:
    """cfg's trace (``compare.build_trace``) with prompt ids below the profile's vocab_size. Raises ValueError if a
    request needs more tokens than the profiled model's max_model_len (when the profile records it)."""
    from minibatch.compare import build_trace
    from minibatch.trace_io import check_fits_context

    requests = build_trace(cfg, None, profile.vocab_size)
    check_fits_context(requests, profile.max_model_len, f"{profile.model}'s ")
    return requests


def run_simulation(cfg, profile_path: str, acceptance_rate=None) -> dict:
    """``python -m minibatch simulate``: the trace of ``cfg`` (a CompareConfig) through each of
    its policies (our engine's only: the HF peers need the model) on the clock calibrated in
    ``profile_path``. Prints the table; returns (and with cfg.json_path writes) the results.

    Raises:
        ValueError: a policy that needs a model (hf_generate, hf_generate_batch); a spec policy
            without acceptance_rate.
    """
    from dataclasses import asdict

    from minibatch.compare import kv_slots
    from minibatch.policies import POLICIES
    from minibatch.report import environment, machine_differences, print_table, write_json
    from minibatch.trace_io import describe_trace

    outside = [p for p in cfg.policies if p not in POLICIES]
    if outside:
        raise ValueError(f"--policies: simulate runs our engine's policies only ({','.join(POLICIES)}); "
                         f"{','.join(outside)} need the real model: use compare")
    profile = Profile.load(profile_path)
    requests = profile_trace(cfg, profile)
    print(f"profile {profile_path}: {profile.model} in {profile.dtype}, calibrated by {profile.meta.get('command')!r}")
    env = environment()
    differs = machine_differences(profile.meta.get("environment", {}), env)
    if differs:  # simulated times are the calibration machine's, with the engine of then
        print(f"note: the profile was measured on another machine or engine ({'; '.join(differs)}): simulated "
              "times are that machine's; python -m minibatch calibrate fits this one")
    print(f"trace: {describe_trace(requests)}")
    runs = simulate_policies(cfg, profile, requests, acceptance_rate)
    result = {"command": cfg.command, "environment": env, "profile": str(profile_path),
              "profile_machine_differences": differs,
              "model": profile.model, "num_requests": len(requests), "acceptance_rate": acceptance_rate,
              "config": asdict(cfg) | {"n_slots": kv_slots(cfg, requests), "policies": list(cfg.policies),
                                       "dtype": profile.dtype},
              "policies": {p: r.row() for p, r in runs.items()}}  # run_time_s: the simulator's own wall time
    print_table(result)
    write_json(result, cfg.json_path)
    return result


def parse_acceptance_rate(text: str | None) -> float | list[float] | None:
    """"0.7" -> 0.7; "0.6,0.3,0.1" -> per-position rates; None -> None.

    Raises:
        ValueError: not numbers in [0, 1], or per-position rates that increase (names --acceptance-rate).
    """
    if text is None:
        return None
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--acceptance-rate must be a number or comma-separated numbers in [0, 1], "
                         f"got {text!r}") from None
    if not all(0.0 <= a <= 1.0 for a in rates):
        raise ValueError(f"--acceptance-rate must be in [0, 1], got {text!r}")
    if any(b > a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"--acceptance-rate per-position rates must be non-increasing (position i+1 is "
                         f"reached only through position i), got {text!r}")
    return rates[0] if len(rates) == 1 else rates
