"""Build an Engine for a named scheduling policy, with matching KV geometry on the executor."""

from __future__ import annotations

from minibatch.engine import Engine
from minibatch.scheduler import OrcaScheduler, StaticScheduler

ENGINE_POLICIES = ("static", "orca")


def make_engine(
    policy: str,
    executor,
    clock=None,
    *,
    max_bs: int = 8,
    n_slots: int = 4096,
    block_size: int = 1,
    max_wait_s: float = 1.0,
) -> Engine:
    """An Engine running ``policy`` on ``executor`` (a ModelRunner or SimExecutor).

    policy: "static" (batch_size = max_bs, padded) or "orca" (iteration-level, max_bs requests,
    n_slots KV token slots). Raises ValueError for an unknown policy.
    """
    if policy == "static":
        scheduler = StaticScheduler(batch_size=max_bs, max_wait_s=max_wait_s)
    elif policy == "orca":
        scheduler = OrcaScheduler(max_bs=max_bs, n_slots=n_slots, block_size=block_size)
        executor.allocate_kv_cache(scheduler.allocator.num_blocks, scheduler.allocator.block_size)
    else:
        raise ValueError(f"policy must be one of {ENGINE_POLICIES}, got {policy!r}")
    return Engine(scheduler, executor, clock)
