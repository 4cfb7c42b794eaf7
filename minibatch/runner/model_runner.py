"""ModelRunner: executes a SchedulerOutput on a real Hugging Face causal LM.

Two layouts, chosen by the scheduler:

* **packed** (selective batching, Orca §3.2): every scheduled token of every request in one row,
  input_ids (1, num_tokens); one forward per step, attention split per request against our own
  KV cache (``runner.attention``). Several prefills share a forward (prefill micro-batching).
* **padded** (static batching): a (B, T) batch, prompts left-padded, an attention mask, and
  transformers' own SDPA attention and DynamicCache, so padding costs real compute.

The model's code is not modified: we register an attention function with transformers, and on a CPU the
Linear and RMSNorm modules may be repacked or re-classed in place (``prepack_weights``, ``fuse_decode_layers``), the
same arithmetic on the same weights.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from minibatch.checks import FieldTypeError, check_token_ids, short_repr
from minibatch.machine import huge_page_zeros, keep_freed_memory
from minibatch.models import eos_token_ids, pad_token_id, set_attention
from minibatch.request import Request
from minibatch.runner import attention
from minibatch.runner.backends import get_backend
from minibatch.runner.batch import PackedSequence, build_packed_batch, pack_sequences
from minibatch.runner.cuda_graphs import DecodeGraphs, graphs_unsupported, model_sliding_window
from minibatch.runner.fused_layers import FusedDecoder, kernel_norms, unsupported
from minibatch.runner.sampler import Sampler, ban_tokens, step_logprobs
from minibatch.runner.kv_owner import KVOwnership, check_kv_fits
from minibatch.runner.prepack import engine_linears, pack_linears, prepack_linears
from minibatch.runner.support import check_packed_support, config_int, config_max_model_len
from minibatch.scheduler.output import SchedulerOutput, StepResult


class ModelRunner(KVOwnership):
    """Runs steps on ``model`` (an HF causal LM on any device/dtype).

    Args:
        model: e.g. from ``minibatch.load_model``.
        tokenizer: optional, used for pad/eos ids and by demos.
        attention_backend: the name of a registered attention backend (``runner.backends``: "torch", the
            reference, gathers K/V by block table and runs SDPA; "triton" runs ``minibatch.kernels``' store_kv
            and paged attention kernels, on a CPU under the Triton interpreter, slowly) or an AttentionBackend.
        vocab_subset: packed steps compute logits only for these token ids (the rest get -inf):
            a draft model's cheaper LM head (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary
            Language Models via Frequency-Ranked Speculative Sampling": a small draft over a 49k vocabulary
            spends most of its time in the LM head; the most frequent tokens carry almost all of its proposals).
            None (default): the whole vocabulary.
        prepack_weights: on a CPU in bfloat16, lay every linear weight out once for oneDNN instead of at each
            call (``runner.prepack``: the same kernel on the same numbers, bit-identical outputs, ~25% less
            matmul time in decode steps); in float32, pack every weight once into panels for our own matrix-product
            kernel (``runner.prepack.pack_linears``: float32 sums in another order than MKL's, used in this
            runner's steps only). Changes the model's Linear modules in place: the HF reference and baselines run
            on the same model object, with the bit-identical bf16 layers and with stock ``F.linear`` in float32.
        fuse_decode_layers: run all-decode packed steps with one C++ call per decoder layer
            (``runner.fused_layers``) where the model, dtype and attention backend allow it (float32 or bf16 on a
            CPU, packed or prepacked linears, the ``cpp`` backend, Llama/Mistral/Qwen2 layers); ``fused_decoder`` is
            None elsewhere, and ``fused_unsupported`` says why. In bf16 the model's RMSNorms then also run the fused
            layers' norm kernel in every step, prefills included (``runner.fused_layers.kernel_norms``: one call
            instead of eight operators, the same output bits; the modules change class in place).

        enforce_eager: run every step eagerly (vLLM's option of that name). Else, on CUDA with an attention backend
            that supports it (``triton``), all-decode steps replay a CUDA graph recorded once per padded batch size
            (``runner.cuda_graphs``: one launch instead of ~1,500); ``decode_graphs`` is None where they do not, and
            ``graphs_unsupported`` says why.

    On a CPU it also makes the C allocator keep freed memory for the next step (``machine.keep_freed_memory``:
    without it every prefill step faults its activations' pages in afresh), for the whole process.

    Raises:
        FieldTypeError: model is not a torch.nn.Module (a name, load_model's pair); vocab_subset not a flat
            sequence of int ids.
        ValueError: vocab_subset empty or an id outside [0, vocab_size); an unknown attention_backend, or one
            that does not support the model's device or dtype.
        NotImplementedError: the model does not run the packed attention exactly (its attention
            does not dispatch through transformers' AttentionInterface, its layers drop
            attn_metadata, packed rows see each other, an attention option we do not implement,
            ...): ``runner.support.check_packed_support``, run once per model object. Also a config
            without the attention geometry (num_hidden_layers, num_attention_heads, hidden_size).

    Attributes:
        kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim) in the model's dtype, on
            its device, made by ``allocate_kv_cache`` (the packed layout only); None before.
        cpu_kv_cache: the same layout with num_cpu_blocks blocks, on the CPU (pinned when the model is on
            CUDA): swap space for ``move_blocks``; None before ``allocate_kv_cache``.
        eos_token_ids: ids that finish a request (unless its sampling has ignore_eos).
        max_model_len: the model's context limit: the first of ``MAX_MODEL_LEN_FIELDS`` its config
            has, else ``NO_POSITION_LIMIT``.
    """

    def __init__(self, model, tokenizer=None, attention_backend: str = "torch", vocab_subset=None,
                 prepack_weights: bool = True, fuse_decode_layers: bool = True, enforce_eager: bool = False):
        if not isinstance(model, torch.nn.Module):  # (a name, or load_model's (model, tokenizer) pair)
            raise FieldTypeError(f"model must be a model object (load_model(name)[0]), got {short_repr(model)}")
        if vocab_subset is not None:  # (before the model's weights are prepacked)
            vocab_subset = check_token_ids(vocab_subset, "vocab_subset", model.get_input_embeddings().num_embeddings)
        self.model = model.eval()
        if prepack_weights:
            prepack_linears(model) or pack_linears(model)
        self.tokenizer = tokenizer
        cfg = model.config.get_text_config()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if self.device.type == "cpu":  # a step's freed activations reused, not faulted in afresh each step
            keep_freed_memory()
        self.num_layers = config_int(model, cfg, "num_hidden_layers")
        self.num_heads = config_int(model, cfg, "num_attention_heads")
        self.num_kv_heads = config_int(model, cfg, "num_key_value_heads", self.num_heads)
        self.head_dim = config_int(model, cfg, "head_dim", config_int(model, cfg, "hidden_size") // self.num_heads)
        self.max_model_len = config_max_model_len(cfg)
        self.eos_token_ids = eos_token_ids(model)
        self.pad_token_id = pad_token_id(model)
        self.vocab_size = model.get_input_embeddings().num_embeddings  # ids >= this cannot be embedded
        self.kv_cache: torch.Tensor | None = None
        self.cpu_kv_cache: torch.Tensor | None = None
        self.attention_backend = get_backend(attention_backend)
        self.attention_backend.check(self.device, self.dtype)
        self.sampler = Sampler()
        self._samplers = weakref.WeakKeyDictionary()  # engine -> its requests' sampler (release_state)
        self._static: dict | None = None  # the running padded batch (static batching)
        self.vocab_subset = (None if vocab_subset is None
                             else torch.as_tensor(vocab_subset, dtype=torch.long, device=self.device))
        if self.vocab_subset is not None:  # the LM head's rows for those ids, contiguous (read once per step)
            head = model.get_output_embeddings()
            self._subset_weight = head.weight.detach()[self.vocab_subset].contiguous()
            self._subset_bias = None if getattr(head, "bias", None) is None else head.bias.detach()[self.vocab_subset]
        attention.register()
        check_packed_support(model, self.num_layers, self.num_kv_heads, self.head_dim)  # once per model
        # the padded layout's KV cache argument: "cache" from transformers 5.24 ("past_key_values"
        # is deprecated there and warns), "past_key_values" before
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # why decode layers are not fused here (None: they are)
        self.fused_unsupported = (unsupported(model, self.attention_backend.name) if fuse_decode_layers
                                  else "fuse_decode_layers=False")
        self.fused_decoder = FusedDecoder(model) if self.fused_unsupported is None else None
        self.sliding_window = model_sliding_window(model)
        self.graphs_unsupported = graphs_unsupported(self, enforce_eager)
        self.decode_graphs = DecodeGraphs(self) if self.graphs_unsupported is None else None
        if self.fused_decoder is not None and self.fused_decoder.prepacked:
            kernel_norms(model)  # bf16: the fused layers' RMSNorm serves the modules too (prefills), the same bits

    # ------------------------------------------------------------------ KV memory
    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        """(Re)allocate the packed layout's KV tensors if the geometry changed, plus
        ``num_cpu_blocks`` blocks of CPU memory for swapping (pinned when the model is on CUDA).

        Raises:
            ValueError: the tensors would not fit in the device's (or the CPU's) free memory;
                the message gives the bytes per token slot and the memory available; or the attention
                backend does not support ``block_size``.
        """
        self.attention_backend.check(self.device, self.dtype, block_size)
        shape = (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        cpu_shape = (self.num_layers, 2, num_cpu_blocks, block_size, self.num_kv_heads, self.head_dim)
        new_gpu = self.kv_cache is None or tuple(self.kv_cache.shape) != shape
        new_cpu = self.cpu_kv_cache is None or tuple(self.cpu_kv_cache.shape) != cpu_shape
        # both sizes checked before anything is freed: a refused size leaves the caches as they were
        nbytes = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        if new_gpu:
            check_kv_fits(num_blocks * block_size, self.kv_bytes_per_token, self.device,
                          "KV cache (num_blocks x block_size, --n-slots)", freed_bytes=nbytes(self.kv_cache))
        if new_cpu:
            check_kv_fits(num_cpu_blocks * block_size, self.kv_bytes_per_token, torch.device("cpu"),
                          "CPU swap space (num_cpu_blocks x block_size)", freed_bytes=nbytes(self.cpu_kv_cache))
        if new_gpu:
            if self.fused_decoder is not None:
                self.fused_decoder.forget_cache()  # its per-layer views would keep the old cache alive
            if self.decode_graphs is not None:
                self.decode_graphs.reset()  # its graphs and buffers read the old cache
            self.kv_cache = None  # free the old one first
            self.kv_cache = (huge_page_zeros(shape, self.dtype) if self.device.type == "cpu"  # fewer TLB misses
                             else torch.zeros(shape, dtype=self.dtype, device=self.device))
        if new_cpu:
            self.cpu_kv_cache = None
            self.cpu_kv_cache = torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def move_blocks(self, out: SchedulerOutput) -> None:
        """The step's block copies, before its forward: swap-outs (GPU -> CPU), swap-ins
        (CPU -> GPU), then copy-on-write copies (GPU -> GPU). Blocks are moved whole, all layers."""
        for pairs, src, dst in ((out.blocks_to_swap_out, self.kv_cache, self.cpu_kv_cache),
                                (out.blocks_to_swap_in, self.cpu_kv_cache, self.kv_cache),
                                (out.blocks_to_copy, self.kv_cache, self.kv_cache)):
            if pairs:
                s, d = zip(*pairs)
                # non_blocking only towards the GPU (ordered on its stream): a non-blocking copy to the CPU
                # returns before the data lands, and the CPU-side index_put_ would read it too early
                dst[:, :, list(d)] = src[:, :, list(s)].to(dst.device, non_blocking=dst.device.type == "cuda")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    # ------------------------------------------------------------------ steps
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step; its result holds request_id -> (sampled token,) for requests that get a token.
        Raises RuntimeError for a packed step before ``allocate_kv_cache`` ("call allocate_kv_cache...")."""
        self.move_blocks(out)
        if out.is_padded_batch:
            logits, request_ids = self._forward_padded(out)
        else:
            logits, request_ids = self.forward_packed(build_packed_batch(out, self._kv(), self.attention_backend))
        sampling = {s.request_id: s.request.sampling for s in out.scheduled}
        banned = {s.request_id: s.request.banned_token_ids() for s in out.scheduled}
        sampled = self.sampler.sample_batch(request_ids, ban_tokens(logits, [banned[rid] for rid in request_ids]),
                                            [sampling[rid] for rid in request_ids])
        tokens = {rid: (t,) for rid, t in sampled.items()}
        rows = {rid: (i, tokens[rid]) for i, rid in enumerate(request_ids)}
        return StepResult(sampled=tokens, logprobs=step_logprobs(logits, rows, sampling))

    def observe_step(self, record) -> None:
        """Nothing to learn from step records (a speculative runner's speculator does)."""

    def _kv(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("call allocate_kv_cache(num_blocks, block_size) before packed steps")
        return self.kv_cache

    @torch.inference_mode()
    def forward_sequences(self, seqs: list[PackedSequence]) -> tuple[torch.Tensor, list[str]]:
        """One packed forward over explicit sequences (a draft model's steps); see ``forward_packed``.
        Raises RuntimeError before ``allocate_kv_cache`` ("call allocate_kv_cache...")."""
        return self.forward_packed(pack_sequences(seqs, self._kv(), self.attention_backend))

    def forward_packed(self, batch) -> tuple[torch.Tensor, list[str]]:
        """Run a :class:`~minibatch.runner.batch.PackedBatch`: returns (logits (num_logits, vocab_size),
        the request_id of each row)."""
        set_attention(self.model, attention.ATTN_IMPLEMENTATION)
        with engine_linears():
            return self._forward_packed(batch)

    def _forward_packed(self, batch) -> tuple[torch.Tensor, list[str]]:
        if self.decode_graphs is not None and (logits := self.decode_graphs.run(batch)) is not None:
            return logits, batch.sample_request_ids  # an all-decode step replayed from its CUDA graph
        hidden = None if self.fused_decoder is None else self.fused_decoder.hidden_states(batch, self._kv())
        if hidden is None:
            inputs = dict(input_ids=batch.input_ids[None],  # (1, num_tokens)
                          position_ids=batch.positions[None],  # (1, num_tokens)
                          attn_metadata=batch.attn_metadata, use_cache=False)
            if self.vocab_subset is None:
                # only the rows we sample from go through the LM head
                logits = self.model(**inputs, logits_to_keep=batch.logits_indices).logits[0]
                return logits, batch.sample_request_ids  # (num_logits, vocab_size)
            hidden = self.model.base_model(**inputs).last_hidden_state[0, batch.logits_indices]  # (num_logits, hidden)
        elif self.vocab_subset is None:
            return self.model.get_output_embeddings()(hidden), batch.sample_request_ids
        sub = torch.nn.functional.linear(hidden, self._subset_weight, self._subset_bias)
        logits = torch.full((hidden.shape[0], self.model.config.vocab_size), float("-inf"),
                            dtype=sub.dtype, device=sub.device)
        logits[:, self.vocab_subset] = sub
        return logits, batch.sample_request_ids

    def _forward_padded(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """Static batching: a padded (B, T) forward with HF's SDPA attention and DynamicCache."""
        from transformers import DynamicCache

        set_attention(self.model, "sdpa")
        rows = sorted(out.scheduled + out.padded, key=lambda s: s.row)
        reqs: list[Request] = [s.request for s in rows]
        if out.new_batch:
            max_len = max(r.num_prompt_tokens for r in reqs)
            ids = torch.full((len(reqs), max_len), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(reqs), max_len), dtype=torch.long)
            for i, r in enumerate(reqs):  # left padding: every row's last token is real
                ids[i, max_len - r.num_prompt_tokens :] = torch.tensor(r.prompt_token_ids)
                mask[i, max_len - r.num_prompt_tokens :] = 1
            cache = DynamicCache(config=self.model.config)
        else:
            ids = torch.tensor([[r.all_token_ids[-1]] for r in reqs])  # (B, 1); finished rows: a pad step
            # A finished row's pad token gets mask 0, so its position stops advancing: a row never runs
            # past its own prompt + max_new_tokens (<= max_model_len), whatever the batch's longest row.
            step_mask = torch.tensor([[0 if r.is_finished else 1] for r in reqs], dtype=torch.long)
            mask = torch.cat([self._static["mask"], step_mask.to(self._static["mask"].device)], dim=1)
            cache = self._static["cache"]
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]  # (B, T) real positions
        with engine_linears():
            logits = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, **{self._cache_kwarg: cache},
                use_cache=True, logits_to_keep=1,
            ).logits[:, -1]  # (B, vocab_size)
        self._static = {"mask": mask, "cache": cache}
        keep = [i for i, s in enumerate(rows) if not s.request.is_finished]
        return logits[keep], [rows[i].request_id for i in keep]

    def free(self, request_ids: list[str]) -> None:
        """Forget per-request state (sampling generators) of finished requests."""
        self.sampler.free(request_ids)

    def release_state(self) -> None:
        """A new engine uses this runner: its own sampler (each engine's seeded generators go on where they were: a
        request preempted by recompute holds no KV, so another engine may step here meanwhile; request ids may repeat
        across engines)."""
        self._static = None  # another engine's padded batch
        self.sampler = self._samplers.setdefault(self._owner(), Sampler())
