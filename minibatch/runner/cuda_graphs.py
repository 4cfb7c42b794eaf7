"""CUDA graphs for decode steps: an all-decode step's forward captured once per batch size and replayed.

On a GPU our eager step is launch-bound: every one of its ~1,500-1,700 kernels is launched from Python, and the
GPU idles most of the step (``data/gpu/step_profile_*``: GPU busy 4-9% of a 20-54 ms step). A CUDA graph records
the step's kernels once and replays them all with one launch. vLLM does the same for its decode steps (its
``cudagraph_capture_sizes``): capture per batch size, pad a batch to the next captured size. What a graph needs,
and how this module gives it:

* **fixed shapes**: a batch of n decodes runs as the smallest captured size b >= n (``capture_sizes``); the b - n
  padding rows (token 0 at position 0) write no K/V (slot -1) and attend to one cached position of block 0; the
  graph ends at the last hidden states, and the LM head runs outside it on the n real rows (vLLM does the same);
* **inputs at fixed addresses**: persistent buffers (input_ids, positions, slot_mapping, block_tables, seq_lens),
  copied into before each replay; the block tables are as wide as the longest context the cache can hold;
* **no host synchronization inside the step**: the attention backend must read block tables and context lengths
  on the GPU (``AttentionBackend.cuda_graphs``: the ``triton`` kernels do; ``torch``/``sdpa`` size their work on
  the host from the lengths, so their steps run eagerly).

Steps with a prefill, speculative verification, a vocabulary subset, more decodes than the largest captured size or a
context past the model's sliding window run eagerly, as before; so does every step after a failed capture
(``DecodeGraphs.disabled`` says why).
"""

from __future__ import annotations

import contextlib

import torch

from minibatch.runner.attention import AttentionMetadata

MAX_CAPTURE_SIZE = 256  # the largest decode batch replayed from a graph (vLLM captures up to 512 by default)
# config fields of models whose forward changes the LM head's output (softcapping, scaling): the graph ends before
# the head, which then runs as a plain linear, so such models run eagerly
LOGIT_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def capture_sizes(max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then every multiple of 8 up to ``max_size`` (vLLM's default list):
    a batch pads by at most 7 rows past 8."""
    return [s for s in (1, 2, 4) if s <= max_size] + list(range(8, max_size + 1, 8))


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``n`` rows; None if none does."""
    return next((s for s in sizes if s >= n), None)


def graphs_unsupported(runner, enforce_eager: bool = False) -> str | None:
    """Why ``runner`` (a ModelRunner) replays no decode graphs, or None when it does: ``enforce_eager``, not on CUDA,
    an attention backend without ``cuda_graphs``, or a vocabulary subset (a draft's LM head)."""
    if enforce_eager:
        return "enforce_eager=True"
    if runner.device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {runner.device.type}"
    if not getattr(runner.attention_backend, "cuda_graphs", False):
        return (f"attention backend {runner.attention_backend.name!r} sizes its work on the host "
                "(backends with CUDA graphs: triton)")
    if runner.vocab_subset is not None:
        return "a vocab_subset (its LM head runs outside the model)"
    cfg = runner.model.config.get_text_config()
    changed = [f for f in LOGIT_FIELDS if getattr(cfg, f, None) not in (None, 1, 1.0)]
    if changed:
        return f"the model post-processes its logits ({', '.join(changed)})"
    return None


def model_sliding_window(model) -> int | None:
    """The shortest sliding window any module of ``model`` (or its config) declares, or None: a graph recorded
    with short contexts must not replay a step whose context exceeds it (such steps run eagerly)."""
    cfg = model.config.get_text_config()
    windows = [getattr(cfg, "sliding_window", None)] + [getattr(m, "sliding_window", None) for m in model.modules()]
    windows = [w for w in windows if isinstance(w, int) and not isinstance(w, bool) and w > 0]
    return min(windows, default=None)


class DecodeGraphs:
    """Captures and replays the packed forward of all-decode steps for one :class:`ModelRunner`.

    Args:
        runner: the ModelRunner (its model, KV cache and attention backend; a backend with ``cuda_graphs``).
        capture: record CUDA graphs (a CUDA device). False runs the same padded forward eagerly: the buffers,
            padding and metadata of a replay, testable on a CPU.
        max_size: the largest captured batch (``MAX_CAPTURE_SIZE``).

    Attributes:
        graphs: batch size -> (its CUDAGraph, or None when not capturing; the graph's output, the last hidden
            states (size, hidden_size), or None).
        replays: steps that ran from the buffers (captured or, with ``capture=False``, eagerly).
        disabled: None, or why every step now runs eagerly (a capture failed: its error).
    """

    def __init__(self, runner, capture: bool = True, max_size: int = MAX_CAPTURE_SIZE):
        self.runner = runner
        self.capture = capture
        self.sizes = capture_sizes(max_size)
        self.graphs: dict[int, tuple] = {}
        self.replays = 0
        self.disabled: str | None = None
        self.pool = None
        self.buffers: dict[str, torch.Tensor] | None = None
        self.kv_cache: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget every graph and buffer (the KV cache was reallocated: the graphs read the old one)."""
        self.graphs, self.buffers, self.kv_cache, self.pool = {}, None, None, None

    def _allocate(self, kv_cache: torch.Tensor) -> None:
        num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
        # a request's table holds distinct blocks, and no more than its longest context needs
        width = min(num_blocks, -(-self.runner.max_model_len // block_size))
        n, device = self.sizes[-1], kv_cache.device
        self.buffers = dict(
            input_ids=torch.zeros(n, dtype=torch.long, device=device),
            positions=torch.zeros(n, dtype=torch.long, device=device),
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros((n, width), dtype=torch.int32, device=device),
            seq_lens=torch.ones(n, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=device))
        self.kv_cache = kv_cache

    def usable(self, batch) -> int | None:
        """The captured size that runs ``batch`` (a PackedBatch), or None if it must run eagerly."""
        m = batch.attn_metadata
        n = len(m.seq_lens)
        if (self.disabled is not None or m.prefill_indices or len(batch.sample_request_ids) != n
                or batch.input_ids.shape[0] != n):
            return None  # a prefill, verification rows, or decodes that return no logits
        window = self.runner.sliding_window
        if window is not None and max(m.seq_lens) > window:
            return None  # the eager step refuses it with its own error
        size = padded_size(n, self.sizes)
        if size is None:
            return None
        if self.buffers is None or self.kv_cache is not m.kv_cache:
            self.reset()
            self._allocate(m.kv_cache)
        return size if m.block_tables.shape[1] <= self.buffers["block_tables"].shape[1] else None

    def run(self, batch) -> torch.Tensor | None:
        """Logits (n, vocab_size) of ``batch``'s n decodes from the graph of its padded size (captured on first use),
        or None: run it eagerly (see :meth:`usable`)."""
        size = self.usable(batch)
        if size is None:
            return None
        m, b, n = batch.attn_metadata, self.buffers, len(batch.attn_metadata.seq_lens)
        # padding rows: token 0 at position 0, writing nowhere (a stale slot would overwrite live K/V), one position
        # of block 0 (stale values would also reach a model's batch-wide position logic)
        for name, value in (("slot_mapping", -1), ("seq_lens", 1), ("input_ids", 0), ("positions", 0)):
            b[name][n:size].fill_(value)
        b["block_tables"][n:size, 0].fill_(0)
        b["input_ids"][:n].copy_(batch.input_ids)
        b["positions"][:n].copy_(batch.positions)
        b["slot_mapping"][:n].copy_(m.slot_mapping)
        b["block_tables"][:n, : m.block_tables.shape[1]].copy_(m.block_tables)
        lens = getattr(m.data, "seq_lens", None)  # the backend's int32 lengths on the device, else from the list
        b["seq_lens"][:n].copy_(lens if torch.is_tensor(lens) else torch.tensor(m.seq_lens, dtype=torch.int32))
        device = torch.cuda.device(self.kv_cache.device) if self.capture else contextlib.nullcontext()
        with device:  # the model's GPU current (cuda:N), for the recording's streams and the replay
            if size not in self.graphs:
                try:
                    self.graphs[size] = self._record(size)
                except Exception as e:  # noqa: BLE001 - a step must not fail because a graph could not be recorded
                    self.disabled = f"capturing a decode batch of {size}: {type(e).__name__}: {e}"
                    self.reset()
                    return None
            graph, hidden = self.graphs[size]
            if graph is None:
                hidden = self._forward(size)
            else:
                graph.replay()
        self.replays += 1
        return self.runner.model.get_output_embeddings()(hidden[:n])  # (n, vocab_size): the LM head, real rows only

    def _forward(self, size: int) -> torch.Tensor:
        """The padded decode forward on the buffers' first ``size`` rows, up to the LM head: (size, hidden_size)."""
        b = self.buffers
        backend = self.runner.attention_backend
        meta = AttentionMetadata(
            kv_cache=self.kv_cache, slot_mapping=b["slot_mapping"][:size], cu_seqlens_q=list(range(size + 1)),
            seq_lens=[1] * size, block_tables=b["block_tables"][:size], prefill_indices=[],
            decode_indices=list(range(size)), backend=backend,
            data=backend.graph_data(b["block_tables"][:size], b["seq_lens"][:size], b["cu_seqlens_q"][: size + 1]))
        ids, positions = b["input_ids"][None, :size], b["positions"][None, :size]
        out = self.runner.model.base_model(input_ids=ids, position_ids=positions, attn_metadata=meta, use_cache=False)
        return out.last_hidden_state[0]

    def _record(self, size: int) -> tuple:
        if not self.capture:
            return None, None
        # the padding values everywhere while recording: the warm-up and capture runs write no K/V
        b = self.buffers
        saved = {k: b[k][:size].clone() for k in ("slot_mapping", "seq_lens")}
        b["slot_mapping"][:size].fill_(-1)
        b["seq_lens"][:size].fill_(1)
        device = self.kv_cache.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # first calls (Triton compiles, allocator warms) outside the capture
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # recorded on a stream of the model's GPU; thread_local: other threads' CUDA calls (a server's) do not
        # invalidate the recording
        capture = torch.cuda.Stream(device)
        with torch.cuda.graph(graph, pool=self.pool, stream=capture, capture_error_mode="thread_local"):
            hidden = self._forward(size)
        self.pool = graph.pool()  # every size shares one memory pool (one replay at a time)
        for k, v in saved.items():
            b[k][:size].copy_(v)
        return graph, hidden
