"""Build an Engine for a named scheduling policy, with matching KV geometry on the executor."""

from __future__ import annotations

from minibatch.checks import (MAX_BLOCK_SIZE, MAX_KV_SLOTS, MAX_NUM_SEQS, MAX_SECONDS, MAX_SPEC_TOKENS, MAX_TOKENS,
                              FieldTypeError, check_choice, check_int, check_real)
from minibatch.engine import Engine
from minibatch.scheduler import (AdaptiveChunker, ChunkedPrefillScheduler, OrcaScheduler, PagedScheduler,
                                 PrefillFirstScheduler, StaticScheduler, make_queue_policy)

ENGINE_POLICIES = ("static", "orca", "paged", "paged_prefix", "prefill_first", "chunked", "chunked_prefix",
                   "spec", "spec_ngram")
PAGED_POLICIES = {"paged": PagedScheduler, "paged_prefix": PagedScheduler, "prefill_first": PrefillFirstScheduler,
                  "chunked": ChunkedPrefillScheduler, "chunked_prefix": ChunkedPrefillScheduler,
                  "spec": PagedScheduler, "spec_ngram": PagedScheduler}
SPEC_POLICIES = ("spec", "spec_ngram")
DEFAULT_CHUNKED_BUDGET = 512


def make_engine(
    policy: str,
    executor,
    clock=None,
    *,
    max_bs: int = 8,
    n_slots: int = 4096,
    block_size: int | None = None,
    max_wait_s: float = 1.0,
    preemption_mode: str = "recompute",
    watermark: float = 0.01,
    reserve_new_tokens: int | None = None,
    max_num_batched_tokens: int | None = None,
    target_itl_s: float | None = None,
    queue_policy: str = "fcfs",
    aging_s: float | None = 1.0,
    max_num_prefills: int | None = None,
    draft_runner=None,
    num_speculative_tokens: int = 4,
    adaptive_k: bool = False,
) -> Engine:
    """An Engine running ``policy`` on ``executor`` (a ModelRunner or SimExecutor).

    policy: "static" (batch_size = max_bs, padded), "orca" (iteration-level, max_bs requests,
    n_slots KV token slots reserved per request at admission), "paged" (vLLM-style on-demand
    blocks over the same n_slots, preempting by ``preemption_mode`` "recompute" or "swap"),
    "prefill_first" (paged; a step is all prefill or all decode, vLLM v0), "chunked" (paged;
    Sarathi-Serve stall-free batching with chunked prefill); "*_prefix" adds prefix caching.
    block_size: slots per KV block; default 1 for orca (Orca's per-token slots) and 16 for paged.
    reserve_new_tokens: orca only: reserve prompt + max(max_new_tokens, this) ("Orca (Max)").
    max_num_batched_tokens: the token budget per step (paged policies); default None (no limit),
        512 for chunked.
    target_itl_s: chunked only: choose the budget per step with an :class:`AdaptiveChunker`
        aiming at this step time (seconds) instead of a fixed budget.
    queue_policy, aging_s: "fcfs", "sjf" or "priority" (aging_s seconds of waiting = one
        priority level; None = no aging) for every iteration-level policy.
    max_num_prefills: prefill_first only: most prompts prefilled per step (None: no limit).
    "spec" / "spec_ngram": paged, with speculative decoding (``minibatch.spec``): drafts from
        ``draft_runner`` (a ModelRunner on a draft model with the target's tokenizer) or from
        n-gram prompt lookup; ``executor`` (a ModelRunner) is wrapped in a SpeculativeRunner.
        num_speculative_tokens: k (>= 1), or with ``adaptive_k`` the largest k AdaptiveK picks.

    Raises:
        ValueError: an unknown policy or a bad argument (the message names it).
    """
    _check_engine_args(policy, executor, max_bs=max_bs, n_slots=n_slots, block_size=block_size,
                       max_wait_s=max_wait_s, preemption_mode=preemption_mode, watermark=watermark,
                       reserve_new_tokens=reserve_new_tokens, max_num_batched_tokens=max_num_batched_tokens,
                       target_itl_s=target_itl_s, max_num_prefills=max_num_prefills,
                       num_speculative_tokens=num_speculative_tokens, adaptive_k=adaptive_k)
    order = make_queue_policy(queue_policy, aging_s)
    if policy == "static":
        return Engine(StaticScheduler(batch_size=max_bs, max_wait_s=max_wait_s), executor, clock)
    if policy == "orca":
        scheduler = OrcaScheduler(max_bs=max_bs, n_slots=n_slots, block_size=1 if block_size is None else block_size,
                                  reserve_new_tokens=reserve_new_tokens, queue_policy=order)
    elif policy in PAGED_POLICIES:
        block_size = 16 if block_size is None else block_size
        if n_slots < block_size:
            raise ValueError(f"n_slots must be >= block_size ({block_size}), got {n_slots}")
        kwargs = dict(max_bs=max_bs, num_blocks=n_slots // block_size, block_size=block_size,
                      enable_prefix_caching=policy.endswith("_prefix"), preemption_mode=preemption_mode,
                      watermark=watermark, queue_policy=order)
        if policy.startswith("chunked"):
            kwargs["max_num_batched_tokens"] = (DEFAULT_CHUNKED_BUDGET if max_num_batched_tokens is None
                                                else max_num_batched_tokens)
            kwargs["chunker"] = AdaptiveChunker(target_itl_s) if target_itl_s is not None else None
        else:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        if policy.startswith("prefill_first"):
            kwargs["max_num_prefills"] = max_num_prefills
        if policy in SPEC_POLICIES:
            executor, kwargs["speculator"] = _speculative_executor(policy, executor, draft_runner,
                                                                   num_speculative_tokens, adaptive_k)
        scheduler = PAGED_POLICIES[policy](**kwargs)
    else:
        raise ValueError(f"policy must be one of {ENGINE_POLICIES}, got {policy!r}")
    return Engine(scheduler, executor, clock)  # the engine allocates the KV cache when it claims the executor


def _check_engine_args(policy: str, executor, **args) -> None:
    """make_engine's arguments, every one checked before anything is built (the schedulers check
    theirs again): the same limits as the run configuration (``minibatch.checks``); an option the
    policy does not use is refused rather than ignored.

    Raises:
        ValueError / FieldTypeError: naming the argument and its allowed range.
    """
    check_choice(policy, "policy", ENGINE_POLICIES)
    if not callable(getattr(executor, "execute", None)):
        raise FieldTypeError(f"executor must be a ModelRunner or SimExecutor (has execute()), got {type(executor).__name__}")
    check_int(args["max_bs"], "max_bs", 1, MAX_NUM_SEQS)
    check_int(args["n_slots"], "n_slots", 1, MAX_KV_SLOTS)
    if args["block_size"] is not None:
        check_int(args["block_size"], "block_size", 1, MAX_BLOCK_SIZE)
    check_real(args["max_wait_s"], "max_wait_s", 0.0, MAX_SECONDS)
    check_choice(args["preemption_mode"], "preemption_mode", ("recompute", "swap"))
    check_real(args["watermark"], "watermark", 0.0, 1.0, high_open=True)
    for name in ("reserve_new_tokens", "max_num_batched_tokens"):
        if args[name] is not None:
            check_int(args[name], name, 1, MAX_TOKENS)
    check_int(args["num_speculative_tokens"], "num_speculative_tokens", 1, MAX_SPEC_TOKENS)
    if not isinstance(args["adaptive_k"], bool):
        raise FieldTypeError(f"adaptive_k must be a bool, got {args['adaptive_k']!r}")
    if args["max_num_prefills"] is not None:
        if not policy.startswith("prefill_first"):
            raise ValueError(f"max_num_prefills needs the prefill_first policy, got {policy!r}")
        check_int(args["max_num_prefills"], "max_num_prefills", 1, MAX_NUM_SEQS)
    if args["target_itl_s"] is not None:
        if not policy.startswith("chunked"):
            raise ValueError(f"target_itl_s (adaptive chunk size) needs a chunked policy, got {policy!r}")
        check_real(args["target_itl_s"], "target_itl_s", 0.0, MAX_SECONDS, low_open=True)


def _speculative_executor(policy: str, executor, draft_runner, k: int, adaptive_k: bool):
    from minibatch.runner.model_runner import SimExecutor
    from minibatch.spec import AdaptiveK, DraftModelProposer, FixedK, NgramProposer, SpeculativeRunner

    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    speculator = AdaptiveK(max_k=k) if adaptive_k else FixedK(k)
    if isinstance(executor, SimExecutor):  # simulation: the executor makes up drafts and accepts them
        if executor.acceptance_rate is None:
            raise ValueError(f"policy {policy!r} on a SimExecutor needs SimExecutor(acceptance_rate=...)")
        return executor, speculator
    if policy == "spec" and draft_runner is None:
        raise ValueError("policy 'spec' needs draft_runner (a ModelRunner on the draft model)")
    proposer = DraftModelProposer(draft_runner) if policy == "spec" else NgramProposer()
    return SpeculativeRunner(executor, proposer, speculator), speculator
