"""Who owns an executor's KV cache, and whether a KV cache fits in memory.

Several engines may share one ModelRunner (``compare`` runs every policy on one model), one after
another: each claims the runner before its steps. Two engines stepping in turn while both hold KV
would write the same blocks, so that is refused instead of silently corrupting both.
"""

from __future__ import annotations

import torch


def check_kv_fits(num_slots: int, bytes_per_slot: int, device: torch.device, what: str,
                  freed_bytes: int = 0) -> None:
    """Raise ValueError unless ``num_slots`` KV token slots of ``bytes_per_slot`` bytes fit in
    ``device``'s free memory (CUDA: ``mem_get_info``; CPU: available RAM) plus ``freed_bytes``
    (a tensor the new one replaces), so an absurd size gets a clear error, not an out-of-memory kill."""
    need = num_slots * bytes_per_slot - freed_bytes
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    if need > free:
        raise ValueError(f"{what}: {num_slots} token slots x {bytes_per_slot} bytes = "
                         f"{num_slots * bytes_per_slot / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free "
                         f"on {device.type}: use fewer KV token slots")


class KVOwnership:
    """An executor's KV cache (and padded-batch state) belongs to one engine at a time.

    ``claim(owner)`` is called by the engine before every step. Handing the executor to another
    engine is refused while the current owner still holds KV in it (``owner.holds_kv``: running
    or swapped requests), because both would write the same blocks. Returns True when the
    ownership changed, so the new owner knows that anything it cached here earlier (its prefix
    cache) may have been overwritten.
    """

    _owner = None  # weakref to the owning engine

    def make_stats(self) -> dict:
        """Run statistics of the executor's own, for a run's row (a speculative executor: "spec_decoding")."""
        return {}

    def claim(self, owner, kv_geometry: tuple[int, int, int] | None = None) -> bool:
        """Make ``owner`` (an Engine) the user of this executor; with ``kv_geometry`` (num_blocks,
        block_size, num_cpu_blocks) the KV cache is (re)allocated to it first. Returns True when
        the owner changed. If the allocation fails, nothing changes hands.

        Raises:
            RuntimeError: another owner still holds KV here. ValueError: the KV cache does not fit.
        """
        import weakref

        current = self._owner() if self._owner is not None else None
        if current is owner:
            return False
        if current is not None and current.holds_kv:
            raise RuntimeError(f"{type(self).__name__} is in use by another engine that still holds KV cache "
                               "(running or swapped requests): give each engine its own runner, or finish one first")
        if kv_geometry is not None:
            self.allocate_kv_cache(*kv_geometry)
        self._owner = weakref.ref(owner)
        self.release_state()
        return True

    def release_state(self) -> None:
        """Forget per-owner state when the executor changes hands (subclasses)."""
