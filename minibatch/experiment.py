"""One way to run a policy on requests and read the result: ``run(policy, requests, executor, clock)``.

Every experiment (``compare``, ``simulate``, the calibration, the simulator's validation, the benchmarks and the
notebooks) runs fresh copies of the same requests through :func:`run` and reads the :class:`Run` it returns: the
requests with their outputs and timestamps, the engine's step records, the metrics summary and a JSON-ready row.

Policies are the rows of ``minibatch.policies.POLICIES`` (our engine) plus the peers of :data:`BASELINES`
(transformers and vLLM), which run through those engines themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property

from minibatch.baselines.vllm_peer import VllmConfig
from minibatch.engine import Engine, StepRecord
from minibatch.metrics import SLO, BenchmarkSummary, summarize
from minibatch.checks import FieldTypeError
from minibatch.config import check_field, opt, setting_fields, settings_of
from minibatch.policies import POLICIES, check_settings, get_policy, make_engine, shared_settings
from minibatch.request import Request
from minibatch.scheduler.config import SchedulerConfig, StaticConfig


def _hf_generate(model, requests: list[Request], config: StaticConfig, progress: bool) -> list[Request]:
    from minibatch.baselines import run_hf_generate

    return run_hf_generate(model, requests, batch_size=config.batch_size, max_wait_s=config.max_wait_s,
                           progress=progress)


def _hf_generate_batch(model, requests: list[Request], config: SchedulerConfig, progress: bool) -> list[Request]:
    from minibatch.baselines import run_hf_generate_batch

    return run_hf_generate_batch(model, requests, progress=progress)


def _vllm(model, requests: list[Request], config, progress: bool):
    from minibatch.baselines.vllm_peer import run_vllm
    return run_vllm(model, requests, config, progress)


@dataclass(frozen=True)
class Baseline:
    """A peer engine: ``run(model, requests, config, progress)`` with its settings' ``config_cls``; returns the
    requests, or (requests, extra columns for the run's row)."""

    name: str
    run: Callable
    config_cls: type

    @property
    def options(self) -> frozenset[str]:
        return frozenset(setting_fields(self.config_cls))

    def make_config(self, settings: dict):
        return self.config_cls(**settings_of(self.config_cls, settings))


# The peers: HF generate on padded static batches (the outside baseline, static batching's settings), transformers'
# own continuous batching (generate_batch, no settings) and vLLM (in a child process, with the same max_num_seqs, KV
# bytes and token budget). They need the model itself (sampling they do not apply is refused: shared.UNSUPPORTED).
BASELINES = {b.name: b for b in (Baseline("hf_generate", _hf_generate, StaticConfig),
                                 Baseline("hf_generate_batch", _hf_generate_batch, SchedulerConfig),
                                 Baseline("vllm", _vllm, VllmConfig))}


def all_policies() -> tuple[str, ...]:
    """Every policy :func:`run` knows: the policy table's rows (registered ones included), then BASELINES."""
    return (*POLICIES, *BASELINES)


def policy_spec(policy: str):
    """The PolicySpec of an engine policy, or the Baseline of an HF peer (both have name, options, make_config)."""
    return BASELINES[policy] if policy in BASELINES else get_policy(policy)


def check_policy_settings(settings: dict, policies: tuple[str, ...], among: tuple[str, ...] | None = None) -> dict:
    """``settings`` checked against the configs of ``policies`` (errors name the command-line option); returns them
    normalised. None is "not set" (dropped), except where a selected policy's field allows None (kept: there it is
    the value, e.g. aging_s=None, no aging). among: the policies the command can run (default all, HF peers included).

    Raises:
        ValueError / FieldTypeError: a setting no selected policy has (naming those that have it), or a value out of
            a selected policy's range."""
    if not isinstance(settings, dict):
        raise FieldTypeError(f"settings must be a dict of policy settings, got {type(settings).__name__}")
    checked = {}
    for name, value in settings.items():
        users = [p for p in policies if name in policy_spec(p).options]
        metas = {p: setting_fields(policy_spec(p).config_cls)[name] for p in users}
        if value is None:
            if any(m["optional"] for m in metas.values()):
                checked[name] = None
            continue
        if not users:
            elsewhere = [f"{p}{'' if p in POLICIES else ' (a peer in compare)'}" for p in among or all_policies()
                         if name in policy_spec(p).options]
            raise ValueError(f"{opt(name)} does not apply to the selected policies ({','.join(policies)})"
                             + (f"; it applies to {', '.join(elsewhere)}" if elsewhere else ""))
        for p, meta in metas.items():
            try:
                value = check_field(meta, value, opt(name))
            except ValueError as e:
                raise type(e)(f"{e} (a setting of policy {p})" if len(users) > 1 else str(e)) from None
        checked[name] = value
    return checked


@dataclass
class Run:
    """One policy's run: ``requests`` (fresh copies, now finished), the ``engine`` (None for an HF
    baseline) and its step ``records``; ``summary`` and ``row()`` are computed on first use."""

    policy: str
    requests: list[Request]
    engine: Engine | None
    run_time_s: float
    slo: SLO | None = None
    extra: dict = field(default_factory=dict)

    @property
    def records(self) -> list[StepRecord]:
        return self.engine.trace if self.engine is not None else []

    @cached_property
    def summary(self) -> BenchmarkSummary:
        return summarize(self.requests, self.records or None, self.slo)

    def row(self, *fields: str, **extra) -> dict:
        """The run as a JSON-ready dict: "policy", the summary's metrics, then prefix-cache and
        speculative-decoding statistics where they apply, the clock, the run's own wall time, then
        ``self.extra`` and ``extra`` (an experiment's own columns, or a new value for a column).

        fields: keep only these keys, in this order (none: every key). An experiment's table is a
            selection, e.g. ``run.row("policy", "ttft_p50_s", "itl_max_s", itl_max_s=...)``.

        Raises:
            ValueError: a field that is neither in the row nor in ``extra`` (the message lists the row's keys).
        """
        row = {"policy": self.policy, **self.summary.to_dict()}
        if self.engine:  # what the scheduler and the executor report of their own (prefix cache, drafts)
            row |= self.engine.scheduler.make_stats() | self.engine.executor.make_stats()
        row["clock"] = self.engine.clock.kind if self.engine else "wall"
        row["run_time_s"] = round(self.run_time_s, 3)
        row |= self.extra | extra
        missing = [f for f in fields if f not in row]
        if missing:
            raise ValueError(f"row field {missing[0]!r} is not in the run's row; its fields are {', '.join(row)}")
        return {f: row[f] for f in fields} if fields else row


def run(policy: str, requests: list[Request], executor, clock=None, *, config=None,
        draft_runner=None, speculator=None, model=None, progress: bool = False, slo: SLO | None = None,
        **options) -> Run:
    """Run fresh copies of ``requests`` under ``policy``; returns the :class:`Run`.

    executor: a ModelRunner or SimExecutor (ignored by BASELINES); clock: default a SimClock.
    config, options, speculator: as ``make_engine`` (a BASELINES policy's settings are its ``config_cls``'s);
    draft_runner: for the policies that draft with a model (a loop over policies passes it to all);
    model: BASELINES only (default ``executor.model``). slo: the latency objectives goodput counts.

    Raises:
        ValueError: an unknown policy or a bad option (named), a baseline with no model; what the engine raises.
    """
    reqs = [r.copy() for r in requests]
    t0 = time.perf_counter()
    if policy in BASELINES:
        baseline, model = BASELINES[policy], model if model is not None else getattr(executor, "model", None)
        if model is None:
            raise ValueError(f"policy {policy!r} runs the model itself: pass model=, or a ModelRunner as executor")
        check_settings(baseline, options)
        out = baseline.run(model, reqs, baseline.make_config(shared_settings(baseline, config) | options), progress)
        extra = out[1] if isinstance(out, tuple) else {}
        return Run(policy, reqs, None, time.perf_counter() - t0, slo, extra=extra)
    drafts = policy in POLICIES and get_policy(policy).proposer == "draft"
    engine = make_engine(policy, executor, clock, config=config, draft_runner=draft_runner if drafts else None,
                         speculator=speculator, **options)
    engine.generate(reqs, progress=progress)
    return Run(policy, reqs, engine, time.perf_counter() - t0, slo)


def same_outputs(runs: Iterable[list[Request]]) -> bool:
    """Whether every run's requests produced the same tokens (True for no runs)."""
    outputs = [[r.output_token_ids for r in reqs] for reqs in runs]
    return all(o == outputs[0] for o in outputs)


def warm_up(runner, draft_runner=None, policies=None) -> None:
    """One tiny run of each of ``policies`` (default: every built-in one) that runs on our engine,
    so first-call costs (both batch layouts, the attention path, the draft) do not land on the
    first measured policy."""
    from minibatch.clock import SimClock
    from minibatch.policies import BUILTIN_POLICIES, get_policy
    from minibatch.request import SamplingParams

    for policy in BUILTIN_POLICIES if policies is None else [p for p in policies if p in POLICIES]:
        if get_policy(policy).proposer == "draft" and draft_runner is None:
            continue
        # two requests of two KV blocks: decode batches and tables of more than one (a compiled kernel's shapes)
        reqs = [Request(f"warmup{i}", list(range(1 + i, 21 + i)), 3, SamplingParams(ignore_eos=True)) for i in range(2)]
        run(policy, reqs, runner, SimClock(), config={"n_slots": 128}, draft_runner=draft_runner)


def load_runner(model_name: str, device: str = "cpu", clock: str = "wall", threads: int | None = None,
                dtype="float32", attention_backend="torch", **runner_options):
    """For benchmark scripts: ``(model, tokenizer, ModelRunner, clock_factory)``, where
    clock_factory() makes a fresh WallClock on ``device`` (clock "wall") or SimClock ("sim").
    threads: torch CPU threads (None: torch's choice); dtype: a torch dtype or a ``--dtype`` name;
    attention_backend: a registered attention backend (``runner.backends``); runner_options: ModelRunner's others."""
    import torch

    from minibatch.clock import SimClock, WallClock
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner

    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name, device=device, dtype=dtype)
    runner = ModelRunner(model, tokenizer, attention_backend=attention_backend, **runner_options)
    return model, tokenizer, runner, (lambda: WallClock(device)) if clock == "wall" else SimClock


def decoding_engine(runner, lengths: list[int], max_new_tokens: int, seed: int = 1, extra_slots: int = 64,
                    block_size: int = 16):
    """A paged engine on ``runner`` (KV blocks of ``block_size`` tokens) whose requests (one per prompt length, random
    token ids drawn with ``seed``, ignore_eos, ``max_new_tokens`` each) are all prefilled: every step from here on is
    a decode of all of them (the step benchmarks' setup). KV room: every prompt plus its output, plus
    ``extra_slots``."""
    import torch

    from minibatch.clock import WallClock
    from minibatch.request import SamplingParams

    engine = make_engine("paged", runner, WallClock(runner.device), max_num_seqs=len(lengths), block_size=block_size,
                         n_slots=sum(lengths) + len(lengths) * (max_new_tokens + block_size) + extra_slots)
    g = torch.Generator().manual_seed(seed)
    for i, length in enumerate(lengths):
        prompt = torch.randint(10, runner.vocab_size, (length,), generator=g).tolist()
        engine.add_request(Request(f"r{i}", prompt, max_new_tokens, SamplingParams(ignore_eos=True)))
    while engine.pending or engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    return engine


def alternating_ms(calls: dict, repeats: int) -> dict:
    """Median milliseconds of each call (name -> a function of no arguments), after one warm-up call each, the calls
    taking turns ``repeats`` times (on a shared machine, a slow minute then costs them all alike)."""
    import statistics

    for call in calls.values():
        call()  # warm-up: first-call costs (allocations, kernel builds, caches) are not timed
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def alternating_step_ms(engines: dict, steps: int) -> dict:
    """Median milliseconds of a step of each engine (name -> Engine), ``steps`` steps each, the engines taking
    turns step by step (:func:`alternating_ms`; the first step after the prefills is the warm-up)."""
    return {name: round(ms, 1) for name, ms in alternating_ms({n: e.step for n, e in engines.items()}, steps).items()}


def default_draft(model: str) -> str:
    """The ``spec`` policy's draft: smollm2-135m-draft for smollm2-135m, else the model itself (self-speculation)."""
    return "smollm2-135m-draft" if model == "smollm2-135m" else model


def check_draft_model(draft_model: str | None, policies) -> None:
    """ValueError when ``draft_model`` is given and no policy of ``policies`` drafts with a model (it is ignored)."""
    if draft_model is not None and not any(p in POLICIES and POLICIES[p].proposer == "draft" for p in policies):
        raise ValueError(f"--draft-model applies only to a draft-model policy (spec), not {','.join(policies)}")


def load_draft_runner(name: str, target_name: str, model, tokenizer, device="cpu", attention_backend: str = "torch",
                      enforce_eager: bool = False):
    """A ModelRunner on the draft model ``name`` (in the target's dtype) for the target ``model`` loaded as
    ``target_name`` (the target's own model object when they are the same: self-speculation), ``enforce_eager`` as
    the target's. smollm2-135m-draft's LM head is cut to the 8192 ids its target uses most (FR-Spec).

    Raises:
        ValueError: the draft's vocab_size differs from the target's (not the same tokenizer).
    """
    from minibatch.models import draft_vocab_subset, load_model
    from minibatch.runner import ModelRunner

    draft = model if name == target_name else load_model(name, device=str(device), dtype=model.dtype)[0]
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"draft model {name!r} has vocab_size {draft.config.vocab_size}, "
                         f"the target {model.config.vocab_size}: they must share a tokenizer")
    subset = draft_vocab_subset() if name == "smollm2-135m-draft" else None
    return ModelRunner(draft, tokenizer, attention_backend=attention_backend, vocab_subset=subset,
                       enforce_eager=enforce_eager)
