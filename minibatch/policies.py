"""Build an Engine for a named scheduling policy, with matching KV geometry on the executor."""

from __future__ import annotations

from minibatch.engine import Engine
from minibatch.scheduler import OrcaScheduler, PagedScheduler, StaticScheduler

ENGINE_POLICIES = ("static", "orca", "paged", "paged_prefix")


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
) -> Engine:
    """An Engine running ``policy`` on ``executor`` (a ModelRunner or SimExecutor).

    policy: "static" (batch_size = max_bs, padded), "orca" (iteration-level, max_bs requests,
    n_slots KV token slots reserved per request at admission), "paged" (vLLM-style on-demand
    blocks over the same n_slots, preempting by ``preemption_mode`` "recompute" or "swap") or
    "paged_prefix" (paged with prefix caching).
    block_size: slots per KV block; default 1 for orca (Orca's per-token slots) and 16 for paged.
    reserve_new_tokens: orca only: reserve prompt + max(max_new_tokens, this) ("Orca (Max)").

    Raises:
        ValueError: an unknown policy or a bad argument.
    """
    if policy == "static":
        return Engine(StaticScheduler(batch_size=max_bs, max_wait_s=max_wait_s), executor, clock)
    if policy == "orca":
        scheduler = OrcaScheduler(max_bs=max_bs, n_slots=n_slots, block_size=block_size or 1,
                                  reserve_new_tokens=reserve_new_tokens)
    elif policy in ("paged", "paged_prefix"):
        block_size = block_size or 16
        if n_slots < block_size:
            raise ValueError(f"n_slots must be >= block_size ({block_size}), got {n_slots}")
        scheduler = PagedScheduler(max_bs=max_bs, num_blocks=n_slots // block_size, block_size=block_size,
                                   enable_prefix_caching=policy == "paged_prefix",
                                   preemption_mode=preemption_mode, watermark=watermark)
    else:
        raise ValueError(f"policy must be one of {ENGINE_POLICIES}, got {policy!r}")
    bm = scheduler.block_manager
    executor.allocate_kv_cache(bm.num_blocks, bm.block_size, bm.num_cpu_blocks)
    return Engine(scheduler, executor, clock)
