"""The main job: one trace through several policies, measured the same way.

    python -m minibatch compare [--policies static,paged,chunked,hf_generate_batch | all] ...

Every policy gets fresh copies of the same requests (``experiment.run``), and every greedy policy's outputs are
checked token for token against HF ``generate`` run on each request alone (``matches_reference``; the reference
outputs are cached on disk, see ``minibatch.reference``). The default policies are the headline comparison: static
batching, paged continuous batching, chunked prefill and transformers' own continuous batching (the peer);
``--policies all`` runs every policy, the outside baseline ``hf_generate`` included.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from minibatch.baselines.shared import check_trace_policies, requests_for
from minibatch.baselines.vllm_peer import PeerUnavailable
from minibatch.checks import (MAX_KV_SLOTS, MAX_NUM_REQUESTS, MAX_RATE, MAX_SECONDS, MAX_TOKENS, MIN_RATE, check_int,
                              comma_list)
from minibatch.config import changed_fields, opt, option
from minibatch.experiment import (BASELINES, Run, all_policies, check_draft_model, check_policy_settings, default_draft,
                                  load_draft_runner, policy_spec, run, warm_up)
from minibatch.metrics import SLO
from minibatch.models import ModelConfig
from minibatch.policies import POLICIES, get_policy
from minibatch.scheduler.config import StaticConfig
from minibatch.report import contention, environment, machine_load, print_table, save_figures, write_json
from minibatch.request import Request
from minibatch.trace_io import check_fits_context, describe_trace
from minibatch.workload import ARRIVALS, build_trace

DEFAULT_POLICIES = ("static", "paged", "chunked", "hf_generate_batch")  # the headline comparison
SIM_DEFAULT_POLICIES = ("static", "orca", "paged", "prefill_first", "chunked")
GENERATOR_OPTIONS = ("num_requests", "arrival", "arrival_cv", "rate", "max_prompt_len", "max_output_len",
                     "output_scale", "long_prompts", "long_prompt_len")  # shape a generated trace: not with --trace

# compare's own defaults for policy settings: a saturating comparison (32 running requests; a padded
# batch waits at most 0.5 s); n_slots defaults to kv_slots()
COMPARE_SETTINGS = {"max_num_seqs": 32, "max_wait_s": 0.5}


@dataclass(frozen=True)
class CompareConfig(ModelConfig):
    """Options of ``python -m minibatch compare`` and ``simulate`` (``--help`` is made from these fields, the model's
    (:class:`~minibatch.models.ModelConfig`, shared with serve and calibrate) and the registered policies' settings).
    Validated on creation: ValueError (FieldTypeError for a wrong type) naming the field as its option and range.

    settings: the policies' settings by name (e.g. ``{"max_num_seqs": 8, "target_itl_s": 0.1}``): each
        applies to every selected policy that has it (``POLICIES[p].config_cls``); one no selected
        policy has is refused. Unset ones take compare's defaults (COMPARE_SETTINGS, kv_slots), then
        the policy's own.
    """

    policies: tuple[str, ...] = option(DEFAULT_POLICIES, "comma-separated policies, or 'all'", "list")
    num_requests: int = option(12, "requests in the generated trace", "int", low=1, high=MAX_NUM_REQUESTS)
    rate: float = option(4.0, "arrival rate, requests/s", "real", low=MIN_RATE, high=MAX_RATE)
    arrival: str = option("poisson", "arrival process", "choice", choices=ARRIVALS)
    arrival_cv: float = option(1.0, "gamma arrivals: coefficient of variation of the gaps (1 = Poisson, > 1 "
                               "burstier)", "real", low=0.0, high=100.0, low_open=True)
    trace: str | None = option(None, "a trace JSON (workload.save_trace) instead of a generated one", "path",
                               optional=True)
    seed: int = option(0, "seed of the generated trace", "int", low=0, high=2**32 - 1)
    max_prompt_len: int = option(256, "clip ShareGPT prompt lengths (tokens)", "int", low=1, high=MAX_TOKENS)
    max_output_len: int = option(256, "clip ShareGPT output lengths (tokens)", "int", low=1, high=MAX_TOKENS)
    output_scale: float = option(0.25, "multiply ShareGPT output lengths by this before clipping (keeps their "
                                 "spread, CPU-sized)", "real", low=0.0, high=1000.0, low_open=True)
    long_prompts: int = option(0, "the long-prompt trace: this many requests get --long-prompt-len tokens",
                               "int", low=0, high=MAX_NUM_REQUESTS)
    long_prompt_len: int = option(1024, "tokens in each long prompt", "int", low=1, high=MAX_TOKENS)
    clock: str = option("wall", "wall: measured; sim: cost-model step times, --profile's or else CostModel's rough "
                        "SmolLM2-on-2-cores defaults (HF peers are always wall)",
                        "choice", choices=("wall", "sim"), cli="model")
    kv_cache_memory_bytes: int | None = option(None, "KV cache as a byte budget instead of --n-slots: n_slots = "
                                               "this // the model's KV bytes per token in --dtype", "int", low=1,
                                               high=1 << 40, optional=True, cli="model")
    profile: str | None = option(None, "a calibrated cost model (python -m minibatch calibrate) for the sim clock",
                                 "path", optional=True)
    slo_ttft_s: float | None = option(2.0, "goodput: TTFT objective, s", "real", low=0.0, high=MAX_SECONDS,
                                      low_open=True, optional=True)
    slo_tpot_s: float | None = option(0.5, "goodput: TPOT objective, s", "real", low=0.0, high=MAX_SECONDS,
                                      low_open=True, optional=True)
    check_reference: bool = option(True, "compare greedy outputs with HF generate on each request alone", "bool",
                                   cli="model", flag="--no-reference")
    reference_cache: str | None = option("default", "folder of cached reference outputs ('default': the user "
                                         "cache; '' = none)", "path", optional=True, cli="model")
    json_path: str | None = option(None, "write the results as JSON here", "path", optional=True)
    figures_dir: str | None = option("figures", "where PNG figures go ('' = none)", "path", optional=True,
                                     cli="model")
    trace_out: str | None = option(None, "write each policy's schedule as a Chrome trace JSON into this folder",
                                   "path", optional=True)
    progress: bool = option(True, "progress bars", "bool", flag="--no-progress")
    command: str | None = option(None, "the command line, recorded in the JSON", "str", optional=True, cli=None)
    settings: dict = field(default_factory=dict)

    def __post_init__(self):
        from minibatch.files import check_output_dir, check_output_file

        super().__post_init__()
        known = all_policies()
        names = known if tuple(self.policies) == ("all",) else tuple(self.policies)
        unknown = [p for p in names if p not in known]
        if isinstance(self.policies, str) or unknown or not names:
            got = ",".join(unknown) if unknown and not isinstance(self.policies, str) else repr(self.policies)
            raise ValueError(f"--policies must be a comma-separated subset of {','.join(known)} or 'all', got {got}")
        if len(set(names)) != len(names):
            raise ValueError(f"--policies lists a policy twice: {','.join(names)}")
        object.__setattr__(self, "policies", names)
        object.__setattr__(self, "settings", check_policy_settings(self.settings, names))
        check_draft_model(self.draft_model, names)
        for p in names:  # each policy's own cross-setting checks, now (n_slots: big here, kv_slots() at the run)
            policy_spec(p).make_config(COMPARE_SETTINGS | {"n_slots": MAX_KV_SLOTS} | self.settings)
        if self.kv_cache_memory_bytes is not None and self.settings.get("n_slots") is not None:
            raise ValueError("--kv-cache-memory-bytes and --n-slots both size the KV cache: give one")
        if self.kv_cache_memory_bytes is not None and not any("n_slots" in policy_spec(p).options for p in names):
            raise ValueError(f"--kv-cache-memory-bytes sizes a KV cache that none of {','.join(names)} has")
        if self.arrival != "gamma" and self.arrival_cv != 1.0:
            raise ValueError("--arrival-cv applies only with --arrival gamma")
        if self.arrival == "zero" and changed_fields(self, ("rate",)):
            raise ValueError("--rate does not apply with --arrival zero (every request arrives at 0 s)")
        if not self.check_reference and self.reference_cache not in (None, "", "default"):
            raise ValueError("--reference-cache applies only with the reference check (not with --no-reference)")
        check_int(self.long_prompts, "--long-prompts (at most --num-requests)", 0, self.num_requests)
        if self.trace is not None and not Path(self.trace).is_file():
            raise ValueError(f"--trace: {self.trace!r} is not a file")
        if self.profile is not None and self.clock != "sim":  # a wall-clock run would silently not use it
            raise ValueError("--profile applies only with --clock sim (a wall-clock run measures its steps)")
        if self.profile is not None and not Path(self.profile).is_file():
            raise ValueError(f"--profile: {self.profile!r} is not a file (make one with python -m minibatch calibrate)")
        if self.json_path is not None:  # output paths: fail now, not after the run
            check_output_file(self.json_path, "--json")
        for name in ("figures_dir", "trace_out") + (("reference_cache",) if self.check_reference else ()):
            if (value := getattr(self, name)) not in (None, "default") and (value or name == "trace_out"):  # '' = none
                check_output_dir(value, opt(name))
        if self.trace is not None:  # a bad trace file fails now; its ids are checked against the vocab later
            from minibatch.trace_io import load_trace

            check_trace_policies(load_trace(self.trace), names)  # a request a policy would refuse mid-comparison
            if given := changed_fields(self, GENERATOR_OPTIONS):
                raise ValueError(f"{opt(given[0])} shapes a generated trace: it does not apply with --trace")

    def policy_config(self, policy: str, requests: list[Request]):
        """The settings of one policy's run (its ``config_cls``): compare's defaults (COMPARE_SETTINGS,
        KV memory from :func:`kv_slots`), then ``settings``. Every policy that has a setting gets the
        same value; one it lacks is not its own (the token budget is only the chunked policies')."""
        cfg = policy_spec(policy).make_config(COMPARE_SETTINGS | {"n_slots": kv_slots(self, requests)} | self.settings)
        return replace(cfg, enforce_eager=self.enforce_eager) if hasattr(cfg, "enforce_eager") else cfg  # vllm's


def compare_config(values: dict, command: str, settings: dict, text: str | None = None) -> CompareConfig:
    """A CompareConfig from option values by field name (``policies`` a list or comma-separated, "all" allowed) for
    ``command`` "model" (compare) or "sim" (simulate: the simulated clock, no reference check, no figures)."""
    values = dict(values)
    names = values.get("policies", DEFAULT_POLICIES if command == "model" else SIM_DEFAULT_POLICIES)
    names = comma_list(names, "--policies") if isinstance(names, str) else tuple(names)
    values["policies"] = tuple(POLICIES) if names == ("all",) and command == "sim" else names
    if command == "sim":
        values.update(clock="sim", check_reference=False, figures_dir=None)
    values |= {name: None for name in ("figures_dir", "reference_cache") if values.get(name) == ""}
    cfg = CompareConfig(**values, settings=settings, command=text)
    if command == "model" and cfg.trace is not None and changed_fields(cfg, ("seed",)):  # simulate's seeds
        raise ValueError("--seed shapes a generated trace: it does not apply with --trace")  # the sim's draws too
    baselines_only = command == "model" and all(p in BASELINES for p in cfg.policies)  # transformers or vLLM runs
    ours = ("clock", "attention_backend", "trace_out") + (() if "vllm" in cfg.policies else ("enforce_eager",))
    if baselines_only and (given := changed_fields(cfg, ours)):
        raise ValueError(f"{opt(given[0])} applies only to our engine's policies, not to {','.join(cfg.policies)}")
    return cfg


def kv_slots(cfg: CompareConfig, requests: list[Request]) -> int:
    """KV memory (token slots) every policy gets: by default what static batching needs for a
    padded batch in the worst case, batch_size * (longest prompt + longest max_new_tokens): every
    row of the (B, T) cache is as long as the batch's longest prompt plus its longest output.
    Same memory for both, as in Orca's evaluation: Orca turns it into a larger batch because it
    reserves each request's own prompt + max_new_tokens, not the batch's longest."""
    longest = max(r.num_prompt_tokens for r in requests) + max(r.max_new_tokens for r in requests)
    batch_size = cfg.settings.get("batch_size", StaticConfig.batch_size)
    return cfg.settings.get("n_slots") or batch_size * longest


def make_compare_clock(cfg: CompareConfig, device="cpu"):
    """cfg.clock's clock: a WallClock, or a SimClock on cfg.profile (calibrated) or the default CostModel."""
    from minibatch.clock import SimClock, make_clock
    from minibatch.sim.cost_model import Profile

    profile = Profile.load(cfg.profile) if cfg.clock == "sim" and cfg.profile else None
    return SimClock(profile, profile) if profile else make_clock(cfg.clock, device)


def run_policies(cfg: CompareConfig, requests: list[Request], executor, clock_factory, *, draft_runner=None,
                 model=None, refs: dict | None = None, rule: str = "exact", policies=None) -> dict[str, Run]:
    """Each of ``policies`` (default cfg.policies) on fresh copies of ``requests``; returns policy -> Run,
    each with its row's ``matches_reference`` and ``reference_check`` (against ``refs`` by ``rule``, see
    ``minibatch.equivalence.check_outputs``) and, with cfg.trace_out, its Chrome trace."""
    slo = SLO(ttft_s=cfg.slo_ttft_s, tpot_s=cfg.slo_tpot_s)
    runs = {}
    for policy in cfg.policies if policies is None else policies:
        config = cfg.policy_config(policy, requests)
        try:
            r = run(policy, requests_for(policy, requests, rule), executor, clock_factory(), config=config,
                    draft_runner=draft_runner, model=model, progress=cfg.progress, slo=slo)
        except PeerUnavailable as e:  # a peer engine that is not installed: its row is skipped, saying why
            print(f"{policy}: skipped: {e}")
            continue
        r.extra["settings"] = asdict(config)
        if refs is not None and cfg.check_reference:
            from minibatch.equivalence import check_outputs

            report = check_outputs(r.requests, refs, rule)
            r.extra["matches_reference"], r.extra["reference_check"] = report["passed"], report
        elif refs is not None:
            r.extra["matches_reference"] = None
        if cfg.trace_out and r.engine is not None:
            from minibatch.viz.chrome_trace import write_chrome_trace

            path = Path(cfg.trace_out) / f"{policy}.trace.json"
            r.extra["chrome_trace"] = str(write_chrome_trace(path, r.records, r.requests, policy))
        runs[policy] = r
    if not runs:  # nothing to show: the command failed (each skip said why above)
        raise ValueError("none of the selected policies could run here (each one's reason is printed above)")
    return runs


def run_compare(cfg: CompareConfig) -> dict:
    """Run the comparison; print a table, save figures and (optionally) JSON. Returns the result dict."""
    from minibatch.equivalence import TOP_K, rule_for, with_logprobs
    from minibatch.kernels.prebuild import start_kernel_builds
    from minibatch.models import load_model
    from minibatch.precision import dtype_name, resolve_dtype
    from minibatch.reference import default_cache_dir, reference_outputs
    from minibatch.runner import ModelRunner, kv_owner

    if cfg.clock == "sim" and cfg.profile:  # a profile prices steps of the dtype it measured (before the model loads)
        from minibatch.sim.cost_model import Profile

        measured_in, runs_in = Profile.load(cfg.profile).dtype, dtype_name(resolve_dtype(cfg.dtype, cfg.device))
        if measured_in != runs_in:
            raise ValueError(f"--profile {cfg.profile} was calibrated in {measured_in}, the model runs in {runs_in}: "
                             f"pass --dtype {measured_in} or a {runs_in} profile")
    load_before = machine_load()  # other busy processes slow a wall-clock run: recorded before and after
    builds = start_kernel_builds(cfg.device, cfg.dtype, cfg.attention_backend)  # compiled while the model loads
    t0 = time.perf_counter()
    model, tokenizer = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    print(f"model {cfg.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params in "
          f"{dtype_name(model.dtype)}, loaded in {time.perf_counter() - t0:.1f} s")
    requests = build_trace(cfg, tokenizer, model.config.vocab_size)
    rule = rule_for(model.dtype)
    if rule != "exact":  # the logprob-close rule needs our top logprobs where a greedy output diverges
        requests = [with_logprobs(r, TOP_K) for r in requests]
    print(f"trace: {describe_trace(requests)}")
    if cfg.clock == "sim" and cfg.profile is None:
        print("clock: simulated by CostModel's default coefficients (rough numbers for smollm2-135m on a 2-core CPU, "
              "whatever the model); --profile FILE prices steps as calibrated")
    runner = ModelRunner(model, tokenizer, attention_backend=cfg.attention_backend, enforce_eager=cfg.enforce_eager)
    if cfg.kv_cache_memory_bytes is not None:
        block = max((getattr(cfg.policy_config(p, requests), "block_size", 1) for p in cfg.policies if p in POLICIES),
                    default=1)
        n_slots = check_int(cfg.kv_cache_memory_bytes // runner.kv_bytes_per_token, "--kv-cache-memory-bytes // "
                            f"{runner.kv_bytes_per_token} KV bytes per token (n_slots: one KV block of {block} "
                            "tokens at least)", block, MAX_KV_SLOTS)
        cfg = replace(cfg, settings=cfg.settings | {"n_slots": n_slots}, kv_cache_memory_bytes=None)
        print(f"KV cache: {n_slots} token slots of {runner.kv_bytes_per_token} bytes")
    check_fits_context(requests, runner.max_model_len)  # before minutes of reference runs
    swap = cfg.settings.get("preemption_mode") == "swap"
    kv_owner.check_kv_fits(kv_slots(cfg, requests) * (2 if swap else 1), runner.kv_bytes_per_token, runner.device,
                  "--n-slots (KV cache" + (" and as much CPU swap space)" if swap else ")"))
    drafts = any(p in POLICIES and get_policy(p).proposer == "draft" for p in cfg.policies)
    draft_name = cfg.draft_model or default_draft(cfg.model)
    draft_runner = load_draft_runner(draft_name, cfg.model, model, tokenizer, runner.device,
                                     cfg.attention_backend, cfg.enforce_eager) if drafts else None
    cache = None if not cfg.reference_cache else default_cache_dir() if cfg.reference_cache == "default" \
        else cfg.reference_cache
    t_ref = time.perf_counter()
    refs = reference_outputs(model, requests, cfg.progress, cache_dir=cache, model_name=cfg.model,
                             logprobs=0 if rule == "exact" else TOP_K) if cfg.check_reference else {}
    if cfg.check_reference:
        print(f"reference: HF generate on each request alone, {time.perf_counter() - t_ref:.1f} s"
              + (f" (cache {cache})" if cache else "") + f"; rule: {rule}")
    builds.join()  # the runner's C++ kernels: a compiler still running would slow the timed runs
    warm_up(runner, draft_runner, cfg.policies)  # after the reference: its attention switch has first-call costs too
    runs = run_policies(cfg, requests, runner, lambda: make_compare_clock(cfg, runner.device),
                        draft_runner=draft_runner, model=model, refs=refs, rule=rule)
    env = environment(load_before)
    contended = contention(env) if cfg.clock == "wall" else None
    result = {"command": cfg.command, "environment": env, "contended": contended,
              "config": asdict(cfg) | {"n_slots": kv_slots(cfg, requests), "policies": list(cfg.policies),
                                       "draft_model": draft_name if drafts else None,
                                       "dtype": dtype_name(model.dtype), "dtype_option": cfg.dtype},
              "num_requests": len(requests), "num_output_tokens": sum(r.max_new_tokens for r in requests),
              "policies": {p: r.row() for p, r in runs.items()}}
    print_table(result)
    if contended:
        print(f"warning: {contended}")
    if cfg.policies != all_policies():
        print("the full table: python -m minibatch compare --policies all")
    if cfg.figures_dir:
        result["figures"] = save_figures(runs, cfg.figures_dir)
    write_json(result, cfg.json_path)
    return result
