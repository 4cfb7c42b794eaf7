"""The attention backend's interface and the registry of backends by name (see the package docstring)."""

from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda")


class AttentionBackend:
    """One way to run the packed step's attention. Class attributes say what it supports; the runner refuses
    the rest with a ValueError (:meth:`check`: device and dtype when it is built, block_size when the KV cache is
    allocated).

    name: the registry key (``--attention-backend NAME``); description: one line saying what it is;
    dtypes: KV cache / activation dtypes it supports; devices: "cpu", "cuda"; sliding_window: whether it masks
    a sliding window (otherwise a model whose window a context exceeds gets NotImplementedError);
    block_sizes: the KV block sizes it supports (None: any); cuda_graphs: its decode steps can be recorded as CUDA
    graphs (no host synchronization, work sized on the GPU from the tables; ``runner.cuda_graphs``), with
    :meth:`graph_data`.
    """

    name: str = ""
    description: str = ""
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    devices: tuple[str, ...] = DEVICES
    sliding_window: bool = False
    block_sizes: tuple[int, ...] | None = None
    cuda_graphs: bool = False

    def check(self, device: torch.device | str, dtype: torch.dtype, block_size: int | None = None) -> None:
        """Raise ValueError naming the setting this backend does not support (device type, dtype, block_size)."""
        kind = torch.device(device).type
        if kind not in self.devices:
            raise ValueError(f"attention_backend {self.name!r} runs on {', '.join(self.devices)}, not {kind}")
        if dtype not in self.dtypes:
            raise ValueError(f"attention_backend {self.name!r} supports dtypes "
                             f"{', '.join(str(d).removeprefix('torch.') for d in self.dtypes)}, not {dtype}")
        if block_size is not None and self.block_sizes is not None and block_size not in self.block_sizes:
            raise ValueError(f"attention_backend {self.name!r} supports block_size in {self.block_sizes}, "
                             f"not {block_size}")

    def prepare(self, meta) -> None:
        """Add this backend's own metadata to ``meta`` (``meta.data``), once per step, before any layer runs."""

    def graph_data(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor):
        """``meta.data`` for a recorded decode step, over persistent buffers (no copies: a replay reads them):
        block_tables (n, max_blocks) int32, seq_lens (n,) int32, cu_seqlens_q (n + 1,) int32. Only for backends
        with ``cuda_graphs``."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")

    def forward(self, meta, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                window: int | None) -> torch.Tensor:
        """Write the step's new K/V to layer ``layer`` of ``meta.kv_cache`` at ``meta.slot_mapping`` and attend.

        q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim), the new tokens only.
        window: None, or a sliding window some context exceeds (only if ``sliding_window`` is True).
        Returns (num_tokens, num_heads, head_dim) in q's dtype."""
        raise NotImplementedError


BACKENDS: dict[str, AttentionBackend] = {}  # name -> backend, like the policy table POLICIES


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Add ``backend`` (an instance) to the registry under ``backend.name``; returns it.

    Raises:
        ValueError: no name, or the name is registered already by another backend."""
    if not backend.name:
        raise ValueError(f"{type(backend).__name__} has no name")
    if backend.name in BACKENDS and type(BACKENDS[backend.name]) is not type(backend):
        raise ValueError(f"attention backend {backend.name!r} is registered already")
    BACKENDS[backend.name] = backend
    return backend


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, built-ins first."""
    return tuple(BACKENDS)


def get_backend(backend: str | AttentionBackend) -> AttentionBackend:
    """The registered backend called ``backend`` (an AttentionBackend passes through).

    Raises:
        ValueError: no backend of that name (the message lists the registered ones)."""
    if isinstance(backend, AttentionBackend):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return BACKENDS[backend]
