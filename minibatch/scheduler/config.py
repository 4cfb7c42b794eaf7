"""Each scheduler's settings, one frozen dataclass per scheduler (as the simulator Vidur, Agrawal et al., MLSys'24,
has one config class per replica scheduler), with vLLM's names where vLLM has the setting.

A scheduler class names its config in ``config_cls`` and reads it in ``from_config``; the policy
table (``minibatch.policies``) registers it with the policy, and the command line offers every
registered policy's fields as options (``--max-num-seqs``...), each checked by the config of every
selected policy that has it. A plug-in policy with a setting of its own subclasses one of these:

    @dataclass(frozen=True)
    class GuardConfig(ChunkedConfig):
        guard_ttft_s: float = option(1.0, "wait after which a request's prefill goes first, s", "real", low=0.0)

Fields made with :func:`~minibatch.config.option` carry their kind, range and help; a config is
checked when it is created (ValueError / FieldTypeError naming the field).
"""

from __future__ import annotations

from dataclasses import dataclass

from minibatch.checks import MAX_BLOCK_SIZE, MAX_KV_SLOTS, MAX_NUM_SEQS, MAX_SECONDS, MAX_SPEC_TOKENS, MAX_TOKENS
from minibatch.config import PREEMPTION_MODES, changed_fields, check_fields, opt, option
from minibatch.scheduler.queue_policy import QUEUE_POLICIES, queue_policy_names


@dataclass(frozen=True)
class SchedulerConfig:
    """The base of every scheduler's config: no settings of its own; checks its fields on creation."""

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class StaticConfig(SchedulerConfig):
    """Static (request-level) batching: a padded batch starts when full or when its oldest request waited."""

    batch_size: int = option(8, "requests per padded batch", "int", low=1, high=MAX_NUM_SEQS)
    max_wait_s: float = option(1.0, "longest wait for a full padded batch, s", "real", low=0.0, high=MAX_SECONDS)


@dataclass(frozen=True)
class IterationConfig(SchedulerConfig):
    """An iteration-level scheduler (Orca §3.1; Algorithm 1 in §4.2): a batch re-formed every step, a KV cache of
    n_slots."""

    max_num_seqs: int = option(8, "most requests running at once", "int", low=1, high=MAX_NUM_SEQS)
    n_slots: int = option(4096, "KV cache size, token slots", "int", low=1, high=MAX_KV_SLOTS)
    block_size: int = option(16, "KV block size in tokens", "int", low=1, high=MAX_BLOCK_SIZE)
    queue_policy: str = option("fcfs", "order of service (a --policy-module may add one)", "choice",
                               choices=queue_policy_names)
    aging_s: float | None = option(1.0, "priority order: seconds of waiting worth one priority level", "real",
                                   low=0.0, high=MAX_SECONDS, low_open=True, optional=True)

    def __post_init__(self):
        super().__post_init__()
        if not getattr(QUEUE_POLICIES.get(self.queue_policy), "takes_aging", False) and self.aging_s is not None \
                and changed_fields(self, ("aging_s",)):  # (a subclass's own queue policy may be unregistered)
            takes = " or ".join(name for name, cls in QUEUE_POLICIES.items() if cls.takes_aging)
            raise ValueError(f"{opt('aging_s')} applies only with {opt('queue_policy')} {takes}")
        if self.n_slots < self.block_size:  # named as options: the scheduler's own check names its arguments
            raise ValueError(f"{opt('n_slots')} (KV cache token slots) must be >= {opt('block_size')} "
                             f"{self.block_size} (one KV block at least), got {self.n_slots}")


@dataclass(frozen=True)
class OrcaConfig(IterationConfig):
    """Orca (OSDI'22): each request's KV reserved at admission, one slot per token by default."""

    block_size: int = option(1, "KV block size in tokens (Orca reserves per token)", "int", low=1,
                             high=MAX_BLOCK_SIZE)
    reserve_new_tokens: int | None = option(
        None, "reserve prompt + max(max_new_tokens, this) (vLLM paper's Orca (Max)); default: prompt + "
        "max_new_tokens (Orca (Oracle))", "int", low=1, high=MAX_TOKENS, optional=True)


@dataclass(frozen=True)
class PagedConfig(IterationConfig):
    """Paged KV (vLLM, SOSP'23 §4.2-§4.5): blocks on demand, preemption when they run out."""

    preemption_mode: str = option("recompute", "what a request preempted when KV runs out loses", "choice",
                                  choices=PREEMPTION_MODES)
    watermark: float = option(0.01, "fraction of KV blocks admission leaves free", "real", low=0.0, high=1.0,
                              high_open=True)
    # set by the policy's row (PolicySpec), not by users
    enable_prefix_caching: bool = option(False, "reuse cached prompt blocks", "bool", cli=None)
    num_lookahead_tokens: int = option(0, "KV slots reserved for a draft model's drafts", "int",
                                       low=0, high=MAX_SPEC_TOKENS, cli=None)


@dataclass(frozen=True)
class PrefillFirstConfig(PagedConfig):
    """vLLM v0's default: a step is all prefill (when anything can be admitted) or all decode."""

    max_num_prefills: int | None = option(None, "most prompts prefilled per step (none: no limit)", "int",
                                          low=1, high=MAX_NUM_SEQS, optional=True)


@dataclass(frozen=True)
class ChunkedConfig(PagedConfig):
    """Stall-free batching with chunked prefill (Sarathi-Serve, OSDI'24 §4): decodes first, then prompt chunks.
    The token budget is chunked prefill's setting: without chunking a budget would have to hold every
    whole prompt (vLLM raises it to max_model_len then)."""

    # 512: vLLM v0's default budget with chunked prefill
    max_num_batched_tokens: int = option(512, "token budget per step: decodes first, then prompt chunks", "int",
                                         low=1, high=MAX_TOKENS)
    target_itl_s: float | None = option(
        None, "adaptive chunk size aiming at this step time, s (none: the fixed budget)", "real", low=0.0,
        high=MAX_SECONDS, low_open=True, optional=True)

    def __post_init__(self):
        super().__post_init__()
        if self.target_itl_s is not None and changed_fields(self, ("max_num_batched_tokens",)):
            raise ValueError(f"{opt('max_num_batched_tokens')} does not apply with {opt('target_itl_s')} (the "
                             "adaptive chunker picks each step's budget)")
