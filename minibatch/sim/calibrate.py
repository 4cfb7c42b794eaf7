"""Calibrate the simulator's clock on this machine: ``python -m minibatch calibrate --model ...``.

Runs small workloads (``minibatch.sim.workloads``: the full grid, or ``--quick``'s smaller one) through the real
engine with a WallClock, so every measured step is a real step (scheduling, the forward, sampling, the update), and
fits a :class:`~minibatch.sim.cost_model.Profile` to the recorded steps.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter

from minibatch.clock import StepShape
from minibatch.sim.cost_model import LAYOUTS, Profile, fit_layout, relative_errors, repeat_spread
from minibatch.sim.workloads import FULL, QUICK, Scenario, draft_scenarios, scenarios

def measure(runner, scenario_list: list[Scenario], progress: bool = True) -> list[dict]:
    """Run each scenario on ``runner`` with a WallClock; one sample per step:
    {"scenario", "layout", shape fields..., "time_s"}."""
    from tqdm.auto import tqdm

    from minibatch.clock import WallClock
    from minibatch.experiment import run

    samples = []
    for sc in tqdm(scenario_list, desc="calibrate", disable=not progress, leave=False):
        for rec in run(sc.policy, sc.requests, runner, WallClock(runner.device), **sc.kwargs).records:
            shape = StepShape.of(rec)
            samples.append({"scenario": sc.name, "layout": sc.layout, **vars(shape), "time_s": rec.duration_s})
    return samples


def measure_draft(runner, draft_runner, scenario_list: list[Scenario], progress: bool = True) -> list[dict]:
    """Run speculative scenarios; one sample per step that drafted: {"scenario", "forwards":
    [[rows, tokens, context], ...], "time_s"} (the draft's share of the step)."""
    from tqdm.auto import tqdm

    from minibatch.clock import WallClock
    from minibatch.experiment import run

    samples = []
    for sc in tqdm(scenario_list, desc="calibrate draft", disable=not progress, leave=False):
        records = run(sc.policy, sc.requests, runner, WallClock(runner.device), draft_runner=draft_runner,
                      **sc.kwargs).records
        samples += [{"scenario": sc.name, "forwards": [list(f) for f in rec.draft_forwards], "time_s": rec.draft_time_s}
                    for rec in records if rec.draft_forwards]
    return samples


def scenario_weights(samples: list[dict]) -> list[float]:
    """1 / (samples of the same scenario): every workload weighs the same in the fit."""
    count = Counter(x["scenario"] for x in samples)
    return [1 / count[x["scenario"]] for x in samples]


def fit_draft(samples: list[dict]):
    """The draft's LayoutModel from :func:`measure_draft` samples: each draft forward is a step
    of the draft model (``Profile.forward_time_s``'s shape); a sample's forwards add up to its
    time. Returns (model, relative errors)."""
    from minibatch.sim.cost_model import StepShape

    groups = [[StepShape(num_tokens=t, logits=r, decode_attention=c) for r, t, c in x["forwards"]] for x in samples]
    times = [x["time_s"] for x in samples]
    model = fit_layout(groups, times, weights=scenario_weights(samples))
    pred = [sum(model.predict(g)) for g in groups]
    return model, relative_errors(pred, times)


def fit_profile(model: str, samples: list[dict], meta: dict | None = None) -> Profile:
    """A Profile fit on ``samples`` (from :func:`measure`), one model per layout present; the fit
    errors (relative, per layout), the repeat spread (per layout: :func:`~minibatch.sim.cost_model.repeat_spread`,
    the machine's noise the fit errors should be read against) and the samples go into ``meta``."""
    from minibatch.sim.cost_model import StepShape

    layouts, errors, spread = {}, {}, {}
    for layout in LAYOUTS:
        rows = [x for x in samples if x["layout"] == layout]
        if not rows:
            continue
        shapes = [StepShape.from_sample(x) for x in rows]
        times = [x["time_s"] for x in rows]
        layouts[layout] = fit_layout(shapes, times, weights=scenario_weights(rows))
        errors[layout] = relative_errors(layouts[layout].predict(shapes), times)
        spread[layout] = repeat_spread(shapes, times)
    return Profile(model=model, layouts=layouts,
                   meta={**(meta or {}), "fit_error": errors, "repeat_spread": spread, "samples": samples})


def default_profile_path(model: str, device: str, dtype: str, attention_backend: str = "torch", quick: bool = False,
                         scale: float = 1.0, enforce_eager: bool = False) -> str:
    """``data/profiles/<model>-<device>[-<dtype> unless float32][-<backend> unless torch][-quick][-scale<S>]
    [-eager].json``: a variant of a calibration never replaces the full one's profile."""
    parts = [model.replace("/", "_"), device.replace(":", ""), "" if dtype == "float32" else dtype,
             "" if attention_backend == "torch" else attention_backend, "quick" if quick else "",
             "" if scale == 1 else f"scale{scale:g}", "eager" if enforce_eager else ""]
    return f"data/profiles/{'-'.join(p for p in parts if p)}.json"


def calibrate(model_name: str, device: str = "cpu", threads: int | None = None, scale: float = 1.0,
              draft_model: str | None = None, progress: bool = True, command: str | None = None,
              dtype="float32", attention_backend: str = "torch", quick: bool = False,
              enforce_eager: bool = False) -> Profile:
    """Measure and fit a Profile for ``model_name`` on ``device`` in ``dtype`` (a torch dtype or a
    ``--dtype`` name; the profile's meta records the dtype measured) (see the module docstring).

    attention_backend: the registered attention backend whose steps are timed (recorded in the meta).
    enforce_eager: no CUDA graphs for the decode steps on a GPU (the meta's ``cuda_graphs`` says whether they ran).
    draft_model: also calibrate this draft (speculative decoding): its decode forwards at
        batch 1..64, fit as ``profile.draft``.
    scale: shrink the workloads (tests and tiny models), 0 < scale <= 1.
    quick: measure ``workloads.QUICK`` (every axis, fewer sizes and steps: about a quarter of the time) instead of
        ``workloads.FULL``; recorded in the meta.

    Raises:
        ValueError: scale out of (0, 1]; an unknown model name (from load_model).
    """
    from minibatch.experiment import load_runner, warm_up
    from minibatch.precision import dtype_name
    from minibatch.report import contention, environment, machine_load

    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    load_before = machine_load()  # a busy machine inflates every measured step: recorded, and warned about
    t0 = time.perf_counter()
    model, tokenizer, runner, _ = load_runner(model_name, device, threads=threads, dtype=dtype,
                                              attention_backend=attention_backend, enforce_eager=enforce_eager)
    if attention_backend == "triton" and runner.device.type == "cpu":  # priced as interpreted, not as compiled
        print("warning: on a CPU the triton kernels run in Triton's interpreter, many times slower than compiled: "
              "this profile prices the interpreter's steps (--attention-backend torch or cpp for a CPU)")
    grid = QUICK if quick else FULL
    work = scenarios(model.config.vocab_size, scale, grid=grid)

    def longest(at: float) -> int:  # the most tokens one calibration request holds at scale ``at``
        return max(r.max_num_tokens for sc in (work if at == scale else scenarios(model.config.vocab_size, at,
                                                                                      grid=grid)) for r in sc.requests)
    if longest(scale) > runner.max_model_len:  # say so before minutes of measuring, not at the scenario that fails
        # the largest scale below this one, in hundredths, whose workloads fit (0: none does)
        low = bisect.bisect_right(range(1, math.ceil(100 * scale)), False,
                                  key=lambda k: longest(k / 100) > runner.max_model_len)
        raise ValueError(f"--scale {scale:g}: the calibration's longest request holds {longest(scale)} tokens, more "
                         f"than {model_name}'s max_model_len {runner.max_model_len}: "
                         + (f"use --scale <= {low / 100:g}" if low else "its context is too short to calibrate"))
    warm_up(runner)
    samples = measure(runner, work, progress)
    env = environment(load_before)
    if contention(env):
        print(f"warning: {contention(env)}")
    meta = {"command": command, "environment": env, "device": str(device), "scale": scale, "quick": quick,
            "enforce_eager": enforce_eager,
            "dtype": dtype_name(model.dtype), "attention_backend": runner.attention_backend.name,
            # whether decode steps were replayed from CUDA graphs (runner.cuda_graphs)
            "cuda_graphs": runner.decode_graphs is not None and runner.decode_graphs.replays > 0,
            "vocab_size": model.config.vocab_size,  # simulate draws its made-up prompt ids below it
            "max_model_len": runner.max_model_len}  # and refuses requests longer than this
    try:
        profile = fit_profile(model_name, samples, meta)
    except ValueError as e:  # too few steps to fit: the workloads were shrunk too far
        raise ValueError(f"{e}: --scale {scale:g}{' with --quick' if quick else ''} leaves too few steps; give a "
                         "larger --scale") from None
    if draft_model:
        add_draft(profile, draft_model, model_name, runner, tokenizer, scale, grid, enforce_eager, progress)
    profile.meta["calibration_time_s"] = round(time.perf_counter() - t0, 1)
    return profile


def print_profile(profile: Profile) -> None:
    """The fitted curve and coefficients, in milliseconds, and the fit errors."""
    for layout, m in profile.layouts.items():
        err = profile.meta.get("fit_error", {}).get(layout, {})
        print(f"{layout}: {sum(x['layout'] == layout for x in profile.meta.get('samples', []))} steps, "
              f"relative error median {err.get('median', float('nan')):.1%}, p90 {err.get('p90', float('nan')):.1%}")
        spread = profile.meta.get("repeat_spread", {}).get(layout, {})
        if spread.get("median") is not None:
            print(f"  repeat spread (the machine's noise: {spread['steps']} steps of a shape measured more than once,"
                  f" from their shape's median): median {spread['median']:.1%}, p90 {spread['p90']:.1%}")
        print("  curve(N) ms: " + ", ".join(f"N={k}: {v * 1e3:.1f}" for k, v in zip(m.knots, m.curve_s)))
        print("  " + ", ".join(f"{name} {v * 1e6:.2f} us" for name, v in m.coef_s.items()))
    if profile.draft:
        print("draft curve(N) ms: " + ", ".join(f"N={k}: {v * 1e3:.2f}" for k, v in
                                                zip(profile.draft.knots, profile.draft.curve_s)))


def refit(profile: Profile) -> Profile:
    """Fit ``profile``'s stored samples again with this code (e.g. after changing the model's
    form): no measuring; the command, environment and samples are kept.

    Raises:
        ValueError: the profile stores no samples, too few, or one that is not a measured step (names its file).
    """
    where = profile.source or "profile"
    if not profile.meta.get("samples"):
        raise ValueError(f"{where}: no stored 'samples' to refit: re-run python -m minibatch calibrate")
    meta = {k: v for k, v in profile.meta.items() if k not in ("fit_error", "repeat_spread", "samples")}
    try:
        new = fit_profile(profile.model, profile.meta["samples"], meta)
        if profile.meta.get("draft_samples"):
            new.draft, new.meta["draft_fit_error"] = fit_draft(profile.meta["draft_samples"])
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a sample edited or cut short
        raise ValueError(f"{where}: its stored samples cannot be fitted again ({type(e).__name__}: {e})") from None
    return new


def calibrate_draft(profile: Profile, draft_model: str, device: str | None = None, threads: int | None = None,
                    scale: float | None = None, progress: bool = True) -> Profile:
    """Add (or replace) ``profile``'s draft model: measure only the draft's scenarios, where and as the profile was
    measured (its device, dtype, attention backend, enforce_eager and grid, full or quick; ``scale`` None: its
    scale).

    Raises:
        ValueError: ``device`` given and not the profile's (its target steps were timed there).
    """
    from minibatch.experiment import load_runner

    measured_on, backend = profile.meta.get("device", "cpu"), profile.meta.get("attention_backend", "torch")
    # (a profile from before enforce_eager was recorded: eager where it was on a GPU and replayed no graphs)
    eager = profile.meta.get("enforce_eager", measured_on.startswith("cuda") and not profile.meta.get("cuda_graphs"))
    if device is not None and device != measured_on:
        raise ValueError(f"--device {device}: the profile was measured on {measured_on}, where its draft is "
                         "measured too (leave --device out)")
    _, tokenizer, runner, _ = load_runner(profile.model, measured_on, threads=threads, dtype=profile.dtype,
                                          attention_backend=backend, enforce_eager=eager)
    scale = profile.meta.get("scale", 1.0) if scale is None else scale
    grid = QUICK if profile.meta.get("quick") else FULL
    add_draft(profile, draft_model, profile.model, runner, tokenizer, scale, grid, eager, progress)
    return profile


def add_draft(profile: Profile, draft_model: str, target_name: str, runner, tokenizer, scale: float, grid,
              enforce_eager: bool, progress: bool) -> None:
    """Measure ``draft_model`` drafting for ``runner`` (the target's: the draft runs on its device and attention
    backend) on the draft scenarios at ``scale`` and ``grid``, and fit ``profile.draft`` (samples kept in the meta)."""
    from minibatch.experiment import load_draft_runner, warm_up

    draft_runner = load_draft_runner(draft_model, target_name, runner.model, tokenizer, runner.device,
                                     runner.attention_backend.name, enforce_eager)
    warm_up(runner, draft_runner)
    samples = measure_draft(runner, draft_runner, draft_scenarios(runner.model.config.vocab_size, scale, grid=grid),
                            progress)
    profile.draft, err = fit_draft(samples)
    profile.meta.update(draft_model=draft_model, draft_fit_error=err, draft_samples=samples)
