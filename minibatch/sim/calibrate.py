"""Calibrate the simulator's clock on this machine: ``python -m minibatch calibrate --model ...``.

Runs small workloads through the real engine with a WallClock, so every measured step is a
real step (scheduling, the forward, sampling, the update), and fits a
:class:`~minibatch.sim.cost_model.Profile` to the recorded steps. The workloads cover the grid
the fit needs (Vidur §4 profiles the same axes per operator):

* decode batches of 1..64 requests at short and long context (batch size, context read),
* whole prefills of one or many prompts (prefill tokens, up to ~2k tokens in a step), and many
  short prompts in one step (rows of a few tokens, each its own attention call),
* speculative verify steps (n-gram lookup on repeating prompts: 1 + k tokens per row),
* chunked prefill mixed with decodes on a Poisson trace with ShareGPT lengths (mixed steps),
* static batches of 1..32 padded requests, up to 64 decode steps (the padded layout).

None of these is a validation trace: ``benchmarks/validate_sim.py`` checks the fit on traces
made with other seeds.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from minibatch.request import Request, SamplingParams
from minibatch.clock import StepShape
from minibatch.sim.cost_model import LAYOUTS, Profile, fit_layout, relative_errors

GREEDY = SamplingParams(ignore_eos=True)


@dataclass
class Scenario:
    """One calibration workload: ``policy`` (a make_engine name) over ``requests``."""

    name: str
    policy: str
    requests: list[Request]
    kwargs: dict

    @property
    def layout(self) -> str:
        from minibatch.policies import get_policy

        return get_policy(self.policy).layout


def _requests(name: str, lengths: list[tuple[int, int]], rng: np.random.Generator, vocab_size: int,
              spacing_s: float = 0.0) -> list[Request]:
    return [Request(f"{name}-{i:03d}", rng.integers(3, vocab_size, size=p).tolist(), o, GREEDY,
                    arrival_time_s=i * spacing_s) for i, (p, o) in enumerate(lengths)]


def scenarios(vocab_size: int, scale: float = 1.0, seed: int = 1234) -> list[Scenario]:
    """The calibration workloads. scale < 1 shrinks batch sizes and lengths (tests, tiny models)."""
    from minibatch.workload import make_trace

    rng = np.random.default_rng(seed)

    def s(x: int) -> int:
        return max(1, round(x * scale))

    big = dict(max_num_seqs=128, n_slots=1 << 16)
    out = []
    for b in sorted({s(b) for b in (1, 2, 4, 8, 16, 32, 64)}):  # decode batches, short context
        out.append(Scenario(f"decode-b{b}", "paged", _requests(f"d{b}", [(s(24), 10)] * b, rng, vocab_size), big))
    for b in sorted({s(b) for b in (1, 4, 8)}):  # long context (and big multi-prompt prefills)
        out.append(Scenario(f"long-b{b}", "paged", _requests(f"l{b}", [(s(320), 6)] * b, rng, vocab_size), big))
    for b in sorted({s(b) for b in (4, 16, 32)}):  # many short multi-token rows in one step
        out.append(Scenario(f"short-rows-b{b}", "paged", _requests(f"r{b}", [(5, 3)] * b, rng, vocab_size), big))
    for b, p in sorted({(s(b), s(p)) for b, p in ((1, 24), (4, 24), (16, 24), (32, 24), (4, 256), (16, 128))}):
        # speculative verify steps (1 + k tokens per row): n-gram lookup on a repeating prompt always finds drafts
        pattern = rng.integers(3, vocab_size, size=8).tolist()
        reqs = [Request(f"v{b}-{p}-{i:03d}", (pattern * (p // 8 + 1))[:p], 12, GREEDY) for i in range(b)]
        out.append(Scenario(f"verify-b{b}-p{p}", "spec_ngram", reqs, dict(big, num_speculative_tokens=4)))
    prefills = [(s(p), 2) for p in (3, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)]
    out.append(Scenario("prefill", "paged", _requests("p", prefills, rng, vocab_size, spacing_s=1e6), big))  # alone
    groups = [(2, 128), (4, 64), (8, 32), (2, 384), (4, 192), (3, 256), (6, 96)]  # B prompts of P tokens together
    reqs = [Request(f"g{b}x{p}-{i}", rng.integers(3, vocab_size, size=s(p)).tolist(), 2, GREEDY, arrival_time_s=1e6 * g)
            for g, (b, p) in enumerate(groups) for i in range(s(b))]
    out.append(Scenario("group-prefill", "paged", reqs, big))
    mixed = make_trace(s(24), rate_per_s=4.0, max_prompt_len=s(256), max_output_len=s(256), output_scale=0.25 * scale,
                       vocab_size=vocab_size, seed=seed)
    for budget in (96, 512):  # chunked prefill: chunks mixed with decodes
        reqs = [Request(f"c{budget}-{r.request_id}", r.prompt_token_ids, r.max_new_tokens, GREEDY,
                        arrival_time_s=r.arrival_time_s) for r in mixed]
        out.append(Scenario(f"chunked-{budget}", "chunked", reqs, dict(big, max_num_batched_tokens=s(budget))))
    for b in sorted({s(b) for b in (1, 2, 4, 8, 16, 32)}):  # static: padded (B, T) batches, long decodes
        n = b if b == s(32) else 3 * b  # three batches each (one prefill step per batch), one of 32
        lengths = [(int(rng.integers(s(16), s(256) + 1)), int(rng.integers(4, s(64) + 1))) for _ in range(n)]
        out.append(Scenario(f"static-b{b}", "static", _requests(f"s{b}", lengths, rng, vocab_size),
                            dict(batch_size=b, max_wait_s=0.0)))
    lengths = [(s(768), 24), (s(64), 24), (s(128), 8), (s(32), 16)]  # one long prompt pads the whole batch
    out.append(Scenario("static-long-b4", "static", _requests("sl", lengths, rng, vocab_size),
                        dict(batch_size=4, max_wait_s=0.0)))
    return out


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


def draft_scenarios(vocab_size: int, scale: float = 1.0, seed: int = 4321) -> list[Scenario]:
    """Speculative decoding with a draft model (k = 4) at batch 1..32, short and long prompts:
    the draft's forwards (its prompt catch-up included) are what these measure."""
    rng = np.random.default_rng(seed)
    out = []
    for b, p in ((1, 24), (4, 24), (16, 24), (32, 24), (1, 300), (8, 200)):
        b, p = max(1, round(b * scale)), max(2, round(p * scale))
        out.append(Scenario(f"draft-b{b}-p{p}", "spec", _requests(f"dr{b}-{p}", [(p, 16)] * b, rng, vocab_size),
                            dict(max_num_seqs=128, n_slots=1 << 16, num_speculative_tokens=4)))
    return out


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
    errors (relative, per layout) and the samples go into ``meta``."""
    from minibatch.sim.cost_model import StepShape

    layouts, errors = {}, {}
    for layout in LAYOUTS:
        rows = [x for x in samples if x["layout"] == layout]
        if not rows:
            continue
        shapes = [StepShape.from_sample(x) for x in rows]
        times = [x["time_s"] for x in rows]
        layouts[layout] = fit_layout(shapes, times, weights=scenario_weights(rows))
        errors[layout] = relative_errors(layouts[layout].predict(shapes), times)
    return Profile(model=model, layouts=layouts, meta={**(meta or {}), "fit_error": errors, "samples": samples})


def calibrate(model_name: str, device: str = "cpu", threads: int | None = None, scale: float = 1.0,
              draft_model: str | None = None, progress: bool = True, command: str | None = None,
              dtype="float32", attention_backend: str = "torch") -> Profile:
    """Measure and fit a Profile for ``model_name`` on ``device`` in ``dtype`` (a torch dtype or a
    ``--dtype`` name; the profile's meta records the dtype measured) (see the module docstring).

    attention_backend: the registered attention backend whose steps are timed (recorded in the meta).
    draft_model: also calibrate this draft (speculative decoding): its decode forwards at
        batch 1..64, fit as ``profile.draft``.
    scale: shrink the workloads (tests and tiny models), 0 < scale <= 1.

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
                                              attention_backend=attention_backend)
    warm_up(runner)
    samples = measure(runner, scenarios(model.config.vocab_size, scale), progress)
    env = environment(load_before)
    if contention(env):
        print(f"warning: {contention(env)}")
    meta = {"command": command, "environment": env, "device": str(device), "scale": scale,
            "dtype": dtype_name(model.dtype), "attention_backend": runner.attention_backend.name,
            "vocab_size": model.config.vocab_size}  # simulate draws its made-up prompt ids below it
    profile = fit_profile(model_name, samples, meta)
    if draft_model:
        from minibatch.experiment import load_draft_runner

        draft_runner = load_draft_runner(draft_model, model_name, model, tokenizer, device, attention_backend)
        warm_up(runner, draft_runner)
        draft_samples = measure_draft(runner, draft_runner, draft_scenarios(model.config.vocab_size, scale), progress)
        profile.draft, err = fit_draft(draft_samples)
        profile.meta.update(draft_model=draft_model, draft_fit_error=err, draft_samples=draft_samples)
    profile.meta["calibration_time_s"] = round(time.perf_counter() - t0, 1)
    return profile


def print_profile(profile: Profile) -> None:
    """The fitted curve and coefficients, in milliseconds, and the fit errors."""
    for layout, m in profile.layouts.items():
        err = profile.meta.get("fit_error", {}).get(layout, {})
        print(f"{layout}: {sum(x['layout'] == layout for x in profile.meta.get('samples', []))} steps, "
              f"relative error median {err.get('median', float('nan')):.1%}, p90 {err.get('p90', float('nan')):.1%}")
        print("  curve(N) ms: " + ", ".join(f"N={k}: {v * 1e3:.1f}" for k, v in zip(m.knots, m.curve_s)))
        print("  " + ", ".join(f"{name} {v * 1e6:.2f} us" for name, v in m.coef_s.items()))
    if profile.draft:
        print("draft curve(N) ms: " + ", ".join(f"N={k}: {v * 1e3:.2f}" for k, v in
                                                zip(profile.draft.knots, profile.draft.curve_s)))


def refit(profile: Profile) -> Profile:
    """Fit ``profile``'s stored samples again with this code (e.g. after changing the model's
    form): no measuring; the command, environment and samples are kept.

    Raises:
        ValueError: the profile stores no samples (names its file).
    """
    if not profile.meta.get("samples"):
        raise ValueError(f"{profile.source or 'profile'}: no stored 'samples' to refit: "
                         "re-run python -m minibatch calibrate")
    meta = {k: v for k, v in profile.meta.items() if k not in ("fit_error", "samples")}
    new = fit_profile(profile.model, profile.meta["samples"], meta)
    if profile.meta.get("draft_samples"):
        new.draft, new.meta["draft_fit_error"] = fit_draft(profile.meta["draft_samples"])
    return new


def calibrate_draft(profile: Profile, draft_model: str, device: str = "cpu", threads: int | None = None,
                    scale: float = 1.0, progress: bool = True) -> Profile:
    """Add (or replace) ``profile``'s draft model: measure only the draft's scenarios."""
    from minibatch.experiment import load_draft_runner
    from minibatch.experiment import load_runner, warm_up

    model, tokenizer, runner, _ = load_runner(profile.model, device, threads=threads, dtype=profile.dtype)
    draft_runner = load_draft_runner(draft_model, profile.model, model, tokenizer, device)
    warm_up(runner, draft_runner)
    samples = measure_draft(runner, draft_runner, draft_scenarios(model.config.vocab_size, scale), progress)
    profile.draft, err = fit_draft(samples)
    profile.meta.update(draft_model=draft_model, draft_fit_error=err, draft_samples=samples)
    return profile
