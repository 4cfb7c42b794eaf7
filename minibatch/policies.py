"""The policy table: every scheduling policy is one row, and ``make_engine`` builds any row.

    static          request-level batching, padded (B, T) batches      (the baseline; Orca §3.1)
    orca            iteration-level batching, KV reserved at admission  (Orca, OSDI'22)
    paged           on-demand KV blocks, preemption                      (vLLM, SOSP'23)
    paged_prefix    paged + prefix caching
    prefill_first   paged; a step is all prefill or all decode          (vLLM v0)
    chunked         stall-free batching with chunked prefill            (Sarathi-Serve, OSDI'24)
    chunked_prefix  chunked + prefix caching
    spec            paged + speculative decoding with a draft model     (Leviathan et al., ICML'23 §2.3)
    spec_ngram      paged + speculative decoding with n-gram lookup     (prompt lookup decoding, Saxena 2023)

A new idea is a scheduler subclass plus one :func:`register_policy` call, in the researcher's own
file (``python -m minibatch compare --policy-module my_policy.py --policies mine,paged``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from minibatch.checks import MAX_SPEC_TOKENS, FieldTypeError, check_choice, check_int
from minibatch.config import setting_fields, settings_of
from minibatch.engine import Engine
from minibatch.scheduler import (ChunkedPrefillScheduler, OrcaScheduler, PagedScheduler, PrefillFirstScheduler,
                                 Scheduler, StaticScheduler)
from minibatch.scheduler.config import SchedulerConfig
from minibatch.spec.speculator import SpecConfig

PROPOSERS = ("draft", "ngram")


@dataclass(frozen=True)
class PolicySpec:
    """One row of the policy table.

    scheduler: the Scheduler subclass (its ``from_config`` builds it, its ``layout`` is "packed" or "padded").
    enable_prefix_caching: reuse cached prompt blocks (paged schedulers).
    proposer: speculative decoding: "draft" (a draft model, ``draft_runner``) or "ngram" (prompt
        lookup); None: none.
    description: one line for ``--help`` and tables.
    improves_on: the policy it is compared against (compare's table prints their ratios), or None.
    config_cls: the policy's settings, a frozen dataclass of ``option`` fields: the scheduler's
        ``config_cls``, plus :class:`~minibatch.spec.speculator.SpecConfig` where there is a proposer.
    """

    name: str
    scheduler: type
    enable_prefix_caching: bool = False
    proposer: str | None = None
    description: str = ""
    config_cls: type = None
    improves_on: str | None = None

    @property
    def layout(self) -> str:
        return self.scheduler.layout

    @property
    def options(self) -> frozenset[str]:
        """The settings a user may give this policy (its config's fields, less those the row sets)."""
        return frozenset(setting_fields(self.config_cls))

    def make_config(self, settings: dict | None = None):
        """The policy's config from ``settings`` (setting name -> value; names the config lacks are
        ignored, None as ``config.settings_of`` says), with the row's own settings (prefix caching,
        lookahead slots for a draft model).

        Raises:
            ValueError / FieldTypeError: a value out of range (names the setting).
        """
        names = {f.name for f in dataclasses.fields(self.config_cls)}
        row = {"enable_prefix_caching": self.enable_prefix_caching} if "enable_prefix_caching" in names else {}
        cfg = self.config_cls(**settings_of(self.config_cls, settings or {}) | row)
        if self.proposer == "draft":
            cfg = dataclasses.replace(cfg, num_lookahead_tokens=cfg.num_speculative_tokens)
        return cfg


POLICIES: dict[str, PolicySpec] = {}


def register_policy(name: str, scheduler: type, *, enable_prefix_caching: bool = False, proposer: str | None = None,
                    description: str = "", config_cls: type | None = None, improves_on: str | None = None,
                    replace: bool = False) -> PolicySpec:
    """Add a row to the policy table (see :class:`PolicySpec`); returns it.

    config_cls: the policy's settings (default: ``scheduler.config_cls``); a speculative policy's
        config adds SpecConfig's fields to it.

    Raises:
        ValueError: a name that is not lowercase letters, digits and "_", or is taken (unless
            ``replace``); a proposer other than "draft" / "ngram", or one on a non-PagedScheduler scheduler.
        FieldTypeError: scheduler is not a Scheduler subclass, or config_cls not a SchedulerConfig subclass.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"policy name must be lowercase letters, digits and '_', starting with a letter, got {name!r}")
    if name in POLICIES and not replace:
        raise ValueError(f"policy {name!r} is already registered (pass replace=True to redefine it)")
    if not (isinstance(scheduler, type) and issubclass(scheduler, Scheduler)):
        raise FieldTypeError(f"scheduler must be a Scheduler subclass, got {scheduler!r}")
    config_cls = scheduler.config_cls if config_cls is None else config_cls
    if not (isinstance(config_cls, type) and issubclass(config_cls, SchedulerConfig)):
        raise FieldTypeError(f"config_cls must be a SchedulerConfig subclass (a frozen dataclass), got {config_cls!r}")
    if proposer is not None:
        check_choice(proposer, "proposer", PROPOSERS)
        if not issubclass(scheduler, PagedScheduler):
            raise ValueError(f"policy {name!r}: speculative decoding needs a PagedScheduler subclass")
        config_cls = _with_spec_config(config_cls)
    POLICIES[name] = PolicySpec(name, scheduler, enable_prefix_caching, proposer, description, config_cls, improves_on)
    return POLICIES[name]


@functools.cache
def _with_spec_config(config_cls: type) -> type:
    """``config_cls`` plus speculative decoding's settings (SpecConfig's fields)."""
    return dataclasses.make_dataclass(f"Spec{config_cls.__name__}", [], bases=(config_cls, SpecConfig), frozen=True)


register_policy("static", StaticScheduler, description="request-level batching, padded batches")
register_policy("orca", OrcaScheduler, description="iteration-level batching, KV reserved at admission",
                improves_on="static")
register_policy("paged", PagedScheduler, description="paged KV blocks on demand, preemption (vLLM)", improves_on="orca")
register_policy("paged_prefix", PagedScheduler, enable_prefix_caching=True, description="paged + prefix caching",
                improves_on="paged")
register_policy("prefill_first", PrefillFirstScheduler, description="paged; steps all prefill or all decode")
register_policy("chunked", ChunkedPrefillScheduler, description="stall-free batching, chunked prefill (Sarathi)",
                improves_on="prefill_first")
register_policy("chunked_prefix", ChunkedPrefillScheduler, enable_prefix_caching=True,
                description="chunked + prefix caching", improves_on="chunked")
register_policy("spec", PagedScheduler, proposer="draft", description="paged + speculative decoding, draft model",
                improves_on="paged")
register_policy("spec_ngram", PagedScheduler, proposer="ngram", description="paged + speculative decoding, n-gram",
                improves_on="paged")
BUILTIN_POLICIES = tuple(POLICIES)


def get_policy(name: str) -> PolicySpec:
    """The row named ``name``. Raises ValueError naming the registered policies."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {','.join(POLICIES)}, got {name!r}")
    return POLICIES[name]


def make_engine(policy: str, executor, clock=None, *, config=None, draft_runner=None, speculator=None,
                **settings) -> Engine:
    """An Engine running ``policy`` (a row of the policy table) on ``executor`` (a ModelRunner or
    SimExecutor), on ``clock`` (default: a SimClock).

    settings: the policy's own settings by name (the fields of ``POLICIES[policy].config_cls``, e.g.
        ``max_num_seqs=4``); one the policy does not have is refused; None means not set.
    config: the policy's config object, or a dict of settings shared by several policies (a loop over
        policies passes one dict; each policy takes the settings it has, a name no policy has is refused).
    draft_runner: "spec" (a draft model): a ModelRunner on the draft model with the target's tokenizer.
    speculator: speculative policies only: a FixedK / AdaptiveK object (e.g. an AdaptiveK told its
        verify_cost_ratio) used instead of the one num_speculative_tokens / adaptive_k would build;
        num_speculative_tokens becomes its ``max_k`` (draft tokens per request and step, and the
        draft model's lookahead KV slots per request).
    Speculative policies wrap a ModelRunner in a SpeculativeRunner; a SimExecutor gets the speculator instead.

    Raises:
        ValueError / FieldTypeError: an unknown policy, a setting out of range or one the policy
            does not have, a missing draft_runner, a speculator on a policy without a proposer or with
            adaptive_k / another num_speculative_tokens also set (the message names the field), a draft_runner
            to a policy without a draft model, a speculative policy on a SimExecutor without acceptance_rate, an
            executor without ``execute()``.
    """
    spec = get_policy(policy)
    if speculator is not None:
        settings["num_speculative_tokens"] = _speculator_max_k(spec, speculator, settings)
    check_settings(spec, settings)
    if draft_runner is not None and spec.proposer != "draft":  # it would be silently unused
        raise ValueError(f"draft_runner applies only to a policy that drafts with a model (spec), not {policy!r}")
    if isinstance(executor, type) or not callable(getattr(executor, "execute", None)):  # before a wrapper hides it
        raise FieldTypeError(f"executor must be a ModelRunner or SimExecutor (has execute()), "
                             f"got {type(executor).__name__}")
    cfg = spec.make_config(shared_settings(spec, config) | settings)
    if spec.proposer:
        executor = _speculative_executor(spec, executor, draft_runner, cfg, speculator)
    return Engine(spec.scheduler.from_config(cfg), executor, clock)  # the KV cache is allocated at the first step


def check_settings(spec, settings: dict) -> None:
    """Refuse a setting (other than None: not set) that ``spec``'s policy (a PolicySpec, or an
    experiment's Baseline) does not have, naming the policies that have it. Raises ValueError."""
    unused = sorted(name for name, value in settings.items() if value is not None and name not in spec.options)
    if unused:
        users = [p for p, row in POLICIES.items() if unused[0] in row.options]
        raise ValueError(f"{unused[0]} does not apply to policy {spec.name!r}" +
                         (f" (it applies to {','.join(users)}; settings shared by several policies go in "
                          "config={...}, where each policy takes those it has)" if users else
                          f"; its settings are {','.join(sorted(spec.options))}"))


def setting_names() -> set[str]:
    """Every registered policy's settings (the names a shared settings dict may use)."""
    return set().union(*(row.options for row in POLICIES.values()))


def shared_settings(spec, config) -> dict:
    """``config`` (None, a settings dict, or a config object ``spec``'s config class derives from) as a dict.

    Raises:
        ValueError / FieldTypeError: a dict key no policy has; an object of another policy's config class.
    """
    if config is None:
        return {}
    if isinstance(config, dict):
        unknown = sorted(set(config) - setting_names())
        if unknown:
            raise ValueError(f"config: no policy has a setting {unknown[0]!r}; settings are "
                             f"{','.join(sorted(setting_names()))}")
        return config
    if not (dataclasses.is_dataclass(config) and issubclass(spec.config_cls, type(config))):
        raise FieldTypeError(f"config must be a dict of settings or the policy's config ({spec.config_cls.__name__} "
                             f"for {spec.name!r}), got {type(config).__name__}")
    return {name: getattr(config, name) for name in setting_fields(type(config))}


def _speculator_max_k(spec: PolicySpec, speculator, options: dict) -> int:
    """``speculator.max_k``, the num_speculative_tokens of a run with this speculator object.

    Raises:
        ValueError / FieldTypeError: ``spec`` has no proposer; speculator has no num_spec_tokens()
            or a max_k outside 1..MAX_SPEC_TOKENS; ``options`` set adaptive_k, or a num_speculative_tokens
            other than max_k.
    """
    if not spec.proposer:
        speculative = ",".join(name for name, row in POLICIES.items() if row.proposer)
        raise ValueError(f"speculator applies only to policies with a proposer ({speculative}), "
                         f"not to policy {spec.name!r}")
    if not callable(getattr(speculator, "num_spec_tokens", None)):
        raise FieldTypeError(f"speculator must be a FixedK or AdaptiveK (has num_spec_tokens()), "
                             f"got {type(speculator).__name__}")
    max_k = check_int(getattr(speculator, "max_k", None), "speculator.max_k", 1, MAX_SPEC_TOKENS)
    if options.get("num_speculative_tokens") not in (None, max_k) or options.get("adaptive_k"):
        name = "adaptive_k" if options.get("adaptive_k") else "num_speculative_tokens"
        raise ValueError(f"{name} does not apply with a speculator object (its max_k = {max_k} sets the draft tokens)")
    return max_k


def _speculative_executor(spec: PolicySpec, executor, draft_runner, cfg: SpecConfig, speculator=None):
    from minibatch.spec import DraftModelProposer, NgramProposer, SpeculativeRunner

    if speculator is None:
        speculator = cfg.speculator()
    if getattr(executor, "simulates_drafts", False):  # a SimExecutor makes up drafts and accepts them
        if executor.acceptance_rate is None:
            raise ValueError(f"policy {spec.name!r} on a SimExecutor needs SimExecutor(acceptance_rate=...)")
        return executor.with_speculator(speculator)  # the caller's executor stays as it was
    if spec.proposer == "draft" and draft_runner is None:
        raise ValueError(f"policy {spec.name!r} needs draft_runner (a ModelRunner on the draft model)")
    proposer = DraftModelProposer(draft_runner) if spec.proposer == "draft" else NgramProposer()
    return SpeculativeRunner(executor, proposer, speculator)
