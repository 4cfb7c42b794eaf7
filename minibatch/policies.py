"""The policy table: every scheduling policy is one row, and ``make_engine`` builds any row.

    static          request-level batching, padded (B, T) batches      (the baseline; Orca §3.1)
    orca            iteration-level batching, KV reserved at admission  (Orca, OSDI'22)
    paged           on-demand KV blocks, preemption                      (vLLM, SOSP'23)
    paged_prefix    paged + prefix caching
    prefill_first   paged; a step is all prefill or all decode          (vLLM v0)
    chunked         stall-free batching with chunked prefill            (Sarathi-Serve, OSDI'24)
    chunked_prefix  chunked + prefix caching
    spec            paged + speculative decoding with a draft model     (Leviathan et al. 2023)
    spec_ngram      paged + speculative decoding with n-gram lookup     (prompt lookup decoding)

A new idea is a scheduler subclass plus one :func:`register_policy` call, in the researcher's own
file (``python -m minibatch compare --policy-module my_policy.py --policies mine,paged``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from minibatch.checks import MAX_SPEC_TOKENS, FieldTypeError, check_choice, check_int
from minibatch.config import EngineConfig
from minibatch.engine import Engine
from minibatch.scheduler import (ChunkedPrefillScheduler, OrcaScheduler, PagedScheduler, PrefillFirstScheduler,
                                 Scheduler, StaticScheduler)

SPEC_OPTIONS = frozenset({"num_speculative_tokens", "adaptive_k"})
# Options every policy accepts, ignored where they do not apply (static batching has no KV cache to
# size), so one set of options can be looped over policies; any other option is refused by a
# policy that does not use it.
SHARED_OPTIONS = StaticScheduler.options | PagedScheduler.options
PROPOSERS = ("draft", "ngram")


@dataclass(frozen=True)
class PolicySpec:
    """One row of the policy table.

    scheduler: the Scheduler subclass (its ``from_config`` builds it, its ``options`` are the
        EngineConfig fields it reads, its ``layout`` is "packed" or "padded").
    enable_prefix_caching: reuse cached prompt blocks (paged schedulers).
    proposer: speculative decoding: "draft" (a draft model, ``draft_runner``) or "ngram" (prompt
        lookup); None: none.
    description: one line for ``--help`` and tables.
    """

    name: str
    scheduler: type
    enable_prefix_caching: bool = False
    proposer: str | None = None
    description: str = ""

    @property
    def layout(self) -> str:
        return self.scheduler.layout

    @property
    def options(self) -> frozenset[str]:
        """The EngineConfig fields this policy uses."""
        return self.scheduler.options | (SPEC_OPTIONS if self.proposer else frozenset())

    def config(self, config: EngineConfig) -> EngineConfig:
        """``config`` with the row's own settings (prefix caching, lookahead slots for a draft model)."""
        lookahead = config.num_speculative_tokens if self.proposer == "draft" else 0
        return config.engine_config(enable_prefix_caching=self.enable_prefix_caching, num_lookahead_tokens=lookahead)


POLICIES: dict[str, PolicySpec] = {}


def register_policy(name: str, scheduler: type, *, enable_prefix_caching: bool = False, proposer: str | None = None,
                    description: str = "", replace: bool = False) -> PolicySpec:
    """Add a row to the policy table (see :class:`PolicySpec`); returns it.

    Raises:
        ValueError: a name that is not lowercase letters, digits and "_", or is taken (unless
            ``replace``); a proposer other than "draft" / "ngram".
        FieldTypeError: scheduler is not a Scheduler subclass.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"policy name must be lowercase letters, digits and '_', starting with a letter, got {name!r}")
    if name in POLICIES and not replace:
        raise ValueError(f"policy {name!r} is already registered (pass replace=True to redefine it)")
    if not (isinstance(scheduler, type) and issubclass(scheduler, Scheduler)):
        raise FieldTypeError(f"scheduler must be a Scheduler subclass, got {scheduler!r}")
    if proposer is not None:
        check_choice(proposer, "proposer", PROPOSERS)
        if not issubclass(scheduler, PagedScheduler):
            raise ValueError(f"policy {name!r}: speculative decoding needs a PagedScheduler subclass")
    POLICIES[name] = PolicySpec(name, scheduler, enable_prefix_caching, proposer, description)
    return POLICIES[name]


register_policy("static", StaticScheduler, description="request-level batching, padded batches")
register_policy("orca", OrcaScheduler, description="iteration-level batching, KV reserved at admission")
register_policy("paged", PagedScheduler, description="paged KV blocks on demand, preemption (vLLM)")
register_policy("paged_prefix", PagedScheduler, enable_prefix_caching=True, description="paged + prefix caching")
register_policy("prefill_first", PrefillFirstScheduler, description="paged; steps all prefill or all decode")
register_policy("chunked", ChunkedPrefillScheduler, description="stall-free batching, chunked prefill (Sarathi)")
register_policy("chunked_prefix", ChunkedPrefillScheduler, enable_prefix_caching=True,
                description="chunked + prefix caching")
register_policy("spec", PagedScheduler, proposer="draft", description="paged + speculative decoding, draft model")
register_policy("spec_ngram", PagedScheduler, proposer="ngram", description="paged + speculative decoding, n-gram")
BUILTIN_POLICIES = tuple(POLICIES)


def load_policy_module(path: str) -> list[str]:
    """Run the Python file ``path`` (a researcher's policy: a scheduler subclass and a
    ``register_policy`` call; or an attention backend and a ``register_backend`` call); returns the names of the
    policies and attention backends it registered.

    Raises:
        ValueError: no such .py file, the file fails to import (its error in one line), or it
            registers no policy and no attention backend.
    """
    import importlib.util
    from pathlib import Path

    from minibatch.runner.backends import backend_names

    file = Path(path)
    if file.suffix != ".py" or not file.is_file():
        raise ValueError(f"--policy-module: no such Python file {str(path)!r}")
    before, backends_before = dict(POLICIES), set(backend_names())
    spec = importlib.util.spec_from_file_location(f"minibatch_policy_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a plug-in's own bug: one line naming the file
        raise ValueError(f"--policy-module {path}: {type(e).__name__}: {e}") from None
    added = [name for name in POLICIES if before.get(name) is not POLICIES[name]]
    added += [name for name in backend_names() if name not in backends_before]
    if not added:
        raise ValueError(f"--policy-module {path}: registers no policy (call minibatch.register_policy) and no "
                         "attention backend (minibatch.runner.backends.register_backend)")
    return added


def get_policy(name: str) -> PolicySpec:
    """The row named ``name``. Raises ValueError naming the registered policies."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {','.join(POLICIES)}, got {name!r}")
    return POLICIES[name]


def make_engine(policy: str, executor, clock=None, *, config: EngineConfig | None = None, draft_runner=None,
                speculator=None, **options) -> Engine:
    """An Engine running ``policy`` (a row of the policy table) on ``executor`` (a ModelRunner or
    SimExecutor), on ``clock`` (default: a SimClock).

    config: an EngineConfig (or a subclass such as CompareConfig) whose fields the policy does not
        use are ignored; options: EngineConfig fields by name: the policy's own, SHARED_OPTIONS, or
        any set to None (not set).
    draft_runner: "spec" (a draft model): a ModelRunner on the draft model with the target's tokenizer.
    speculator: speculative policies only: a FixedK / AdaptiveK object (e.g. an AdaptiveK told its
        verify_cost_ratio) used instead of the one num_speculative_tokens / adaptive_k would build;
        num_speculative_tokens becomes its ``max_k`` (draft tokens per request and step, and the
        draft model's lookahead KV slots per request).
    Speculative policies wrap a ModelRunner in a SpeculativeRunner; a SimExecutor gets the
    speculator instead (it makes up drafts and accepts them at its acceptance_rate).

    Raises:
        ValueError / FieldTypeError: an unknown policy, an option out of range or one the policy
            does not use, a missing draft_runner, a speculator on a policy without a proposer or with
            adaptive_k / another num_speculative_tokens also set (the message names the field).
    """
    spec = get_policy(policy)
    if speculator is not None:
        options["num_speculative_tokens"] = _speculator_max_k(spec, speculator, options)
    unused = sorted(name for name, value in options.items()
                    if value is not None and name not in spec.options | SHARED_OPTIONS)
    if unused:
        users = [p for p, row in POLICIES.items() if unused[0] in row.options]
        known = unused[0] in EngineConfig.engine_fields()
        raise ValueError(f"{unused[0]} does not apply to policy {policy!r}" +
                         (f" (it applies to {','.join(users)})" if known else
                          f"; its options are {','.join(sorted(spec.options))}"))
    if not callable(getattr(executor, "execute", None)):
        raise FieldTypeError(f"executor must be a ModelRunner or SimExecutor (has execute()), "
                             f"got {type(executor).__name__}")
    cfg = spec.config((config or EngineConfig()).engine_config(**options))
    if spec.proposer:
        executor = _speculative_executor(spec, executor, draft_runner, cfg, speculator)
    return Engine(spec.scheduler.from_config(cfg), executor, clock)  # the KV cache is allocated at the first step


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


def _speculative_executor(spec: PolicySpec, executor, draft_runner, cfg: EngineConfig, speculator=None):
    from minibatch.spec import AdaptiveK, DraftModelProposer, FixedK, NgramProposer, SpeculativeRunner

    if speculator is None:
        k = cfg.num_speculative_tokens
        speculator = AdaptiveK(max_k=k) if cfg.adaptive_k else FixedK(k)
    if getattr(executor, "simulates_drafts", False):  # a SimExecutor makes up drafts and accepts them
        if executor.acceptance_rate is None:
            raise ValueError(f"policy {spec.name!r} on a SimExecutor needs SimExecutor(acceptance_rate=...)")
        return executor.with_speculator(speculator)  # the caller's executor stays as it was
    if spec.proposer == "draft" and draft_runner is None:
        raise ValueError(f"policy {spec.name!r} needs draft_runner (a ModelRunner on the draft model)")
    proposer = DraftModelProposer(draft_runner) if spec.proposer == "draft" else NgramProposer()
    return SpeculativeRunner(executor, proposer, speculator)
