"""Configuration dataclasses whose fields carry their own limits and help: one source for the
Python API, the checks and the command line (``minibatch.cli`` derives its options from them).

A field made with :func:`option` states its kind ("int", "real", "choice", "bool", "str"), range
and help; :func:`check_fields` validates every such field of an instance, naming the field as
``name_of(field)`` (its CLI option at the command line, its own name in Python).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable

from minibatch.checks import (MAX_BLOCK_SIZE, MAX_KV_SLOTS, MAX_NUM_SEQS, MAX_SECONDS, MAX_SPEC_TOKENS, MAX_TOKENS,
                              FieldTypeError, check_choice, check_int, check_real, check_str)

QUEUE_POLICIES = ("fcfs", "sjf", "priority")
PREEMPTION_MODES = ("recompute", "swap")


def option(default, help: str, kind: str, *, low=None, high=None, choices=(), optional: bool = False,
           low_open: bool = False, high_open: bool = False, cli: str | None = "all", flag: str | None = None):
    """A dataclass field with its check and its help. kind: "int" | "real" | "choice" | "bool" |
    "str" | "path" | "list" (checked by the dataclass itself); choices: a tuple, or a callable returning the
    allowed values when the option is checked (a registry); optional: None is allowed; cli: which
    commands offer it ("all", "model": compare only, "sim": simulate only, None: none); flag: its
    command-line spelling if not ``--field-name`` (a bool that defaults to True gets ``--no-...``)."""
    meta = dict(help=help, kind=kind, low=low, high=high, choices=choices if callable(choices) else tuple(choices),
                optional=optional,
                low_open=low_open, high_open=high_open, cli=cli, flag=flag)
    return field(default=default, metadata=meta)


def choices_of(meta) -> tuple:
    """A "choice" option's allowed values: its ``choices``, or what they return when they are a callable (a
    registry read when the option is checked, e.g. the attention backends, which plug-ins may add to)."""
    choices = meta["choices"]
    return tuple(choices()) if callable(choices) else choices


def check_fields(obj, name_of: Callable[[str], str] = str) -> None:
    """Check (and normalise: numpy ints become ints) every :func:`option` field of ``obj``.

    Raises:
        ValueError / FieldTypeError: the first bad field, named by ``name_of(field_name)``.
    """
    for f in dataclasses.fields(obj):
        m = f.metadata
        if "kind" not in m:
            continue
        value, name = getattr(obj, f.name), name_of(f.name)
        if value is None and m["optional"]:
            continue
        if m["kind"] == "int":
            value = check_int(value, name, m["low"], m["high"])
        elif m["kind"] == "real":
            value = check_real(value, name, m["low"], m["high"], low_open=m["low_open"], high_open=m["high_open"])
        elif m["kind"] == "choice":
            check_choice(value, name, choices_of(m))
        elif m["kind"] == "bool" and not isinstance(value, bool):
            raise FieldTypeError(f"{name} must be a bool, got {value!r}")
        elif m["kind"] == "str":
            check_str(value, name)
        elif m["kind"] == "path" and not isinstance(value, (str, os.PathLike)):
            raise FieldTypeError(f"{name} must be a path (str) or None, got {value!r}")
        object.__setattr__(obj, f.name, value)


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option, with vLLM's names where vLLM has the option. A policy uses some of
    them (``PolicySpec.options``); ``make_engine`` refuses an option the policy does not use."""

    max_wait_s: float = option(1.0, "static batching: longest wait for a full batch, s", "real",
                               low=0.0, high=MAX_SECONDS)
    max_num_seqs: int = option(8, "most requests running at once (static batching: requests per padded batch)",
                               "int", low=1, high=MAX_NUM_SEQS)
    n_slots: int = option(4096, "KV cache size, token slots", "int", low=1, high=MAX_KV_SLOTS)
    block_size: int | None = option(None, "KV block size in tokens (default: 1 for orca, 16 for paged policies)",
                                    "int", low=1, high=MAX_BLOCK_SIZE, optional=True)
    reserve_new_tokens: int | None = option(
        None, "orca: reserve prompt + max(max_new_tokens, this) (Orca (Max)); default: prompt + max_new_tokens",
        "int", low=1, high=MAX_TOKENS, optional=True)
    preemption_mode: str = option("recompute", "paged policies: what a request preempted when KV runs out loses",
                                  "choice", choices=PREEMPTION_MODES)
    watermark: float = option(0.01, "paged policies: fraction of KV blocks admission leaves free", "real",
                              low=0.0, high=1.0, high_open=True)
    max_num_batched_tokens: int | None = option(
        None, "token budget per step (chunked policies: default 512; in compare, others get none)", "int",
        low=1, high=MAX_TOKENS,
        optional=True)
    target_itl_s: float | None = option(
        None, "chunked: adaptive chunk size aiming at this step time, s", "real", low=0.0, high=MAX_SECONDS,
        low_open=True, optional=True)
    max_num_prefills: int | None = option(None, "prefill_first: most prompts prefilled per step", "int",
                                          low=1, high=MAX_NUM_SEQS, optional=True)
    queue_policy: str = option("fcfs", "order of service of iteration-level policies", "choice",
                               choices=QUEUE_POLICIES)
    aging_s: float | None = option(1.0, "priority order: seconds of waiting worth one priority level", "real",
                                   low=0.0, high=MAX_SECONDS, low_open=True, optional=True)
    num_speculative_tokens: int = option(4, "spec policies: draft tokens per step, k (with adaptive k: the largest)",
                                         "int", low=1, high=MAX_SPEC_TOKENS)
    adaptive_k: bool = option(False, "spec policies: choose k per request from its acceptance history", "bool")
    # set by the policy's row, not by users
    enable_prefix_caching: bool = option(False, "reuse cached prompt blocks", "bool", cli=None)
    num_lookahead_tokens: int = option(0, "KV slots reserved for a draft model's drafts", "int",
                                       low=0, high=MAX_SPEC_TOKENS, cli=None)

    def __post_init__(self):
        check_fields(self)

    @classmethod
    def engine_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(EngineConfig))

    def engine_config(self, **overrides) -> "EngineConfig":
        """The EngineConfig part of this config (a subclass such as CompareConfig adds run options),
        with ``overrides`` (EngineConfig fields) replaced."""
        if type(self) is EngineConfig and not overrides:
            return self
        return EngineConfig(**({name: getattr(self, name) for name in EngineConfig.engine_fields()} | overrides))
