"""Fused decode layers: a packed step of a Llama-family model with one C++ call per decoder layer.

The packed forward (``ModelRunner.forward_packed``) runs the unmodified transformers model: per layer ~40 small
operators (two RMSNorms, rotary embedding, views, residual adds, SiLU) around 7 matrix products and attention. At
the few rows of a decode step each small operator costs microseconds of dispatch and Python, not arithmetic: on a
2-core CPU about a quarter of a 32-request step of SmolLM2-135M (``python -m minibatch profile``). vLLM and SGLang
remove that overhead with their own model code and CUDA graphs; here :class:`FusedDecoder` reads transformers' own
modules once and, for a step whose every request decodes one token, runs each layer as
``kernels.cpu_decode_layer.decode_layer`` (the same packed matrix product and paged decode kernel the modules would
call, and the small operators in the same float32 order). In bf16 each layer is
``kernels.cpu_decode_layer.decode_layer_prepacked``: the operators the modules run, in their order and dtype, on
the same prepacked products as the modules' in the engine's steps (q/k/v and gate/up each one product; oneDNN's, or
our AMX or AVX512-BF16 kernel on the same bytes: ``runner.prepack.prepacked_product``), called from C++, so the
logits are bit for bit the modules'. Embedding, the rotary module's cos/sin, the final norm and the LM head
stay the model's own modules.

It applies only where the result is the same computation: a float32 model on a CPU whose linears are packed
(``runner.prepack.pack_linears``) or a bf16 one whose linears are prepacked and grouped
(``runner.prepack.prepack_linears``), the ``cpp`` attention backend, and a model, model body and decoder layers
whose classes are exactly transformers' Llama, Mistral or Qwen2 ones, with a SiLU MLP (:func:`unsupported` says why
not). In bf16, where the ``cpp`` backend runs its prefill kernel (``kernels.cpu_prefill``: AVX512-BF16), steps
with rows of several tokens (prefills, chunks, speculative verifications; mixed with decodes or not) run fused too,
their attention on that kernel. Every other step (rows of several tokens otherwise; the support probe; a module
replaced or a weight edited after packing) runs the model's own forward. float32 outputs
are float32 sums in another order than the modules' in the last bits (the mean of squares, like the packed
products); the engine's float32 tokens stay exact against Hugging Face ``generate``, and bf16 steps give the
modules' logits exactly (tests/test_fused_layers.py).
"""

from __future__ import annotations

import operator

import torch

from minibatch.kernels import cpu_amx_linear, cpu_bf16_linear, cpu_decode_layer
from minibatch.runner import prepack
from minibatch.runner.prepack import PANEL_MAX_ROWS, GroupedLinear, PanelLinear, PrepackedLinear

# transformers' models whose forward decode_layer reproduces: module -> (causal LM, model, decoder layer, attention,
# MLP, RMSNorm), each class exactly (a subclass, or another model around these layers, may do more: scale the
# embeddings or the residuals, add norms)
SUPPORTED = {
    "transformers.models.llama.modeling_llama": ("LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer",
                                                 "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "transformers.models.mistral.modeling_mistral": ("MistralForCausalLM", "MistralModel", "MistralDecoderLayer",
                                                     "MistralAttention", "MistralMLP", "MistralRMSNorm"),
    "transformers.models.qwen2.modeling_qwen2": ("Qwen2ForCausalLM", "Qwen2Model", "Qwen2DecoderLayer",
                                                 "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
}
# what the fused call reads of a decoder layer, in its order: (owner: "" = the layer itself, name in the owner)
PARTS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
         ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"), ("", "input_layernorm"),
         ("", "post_attention_layernorm"), ("mlp", "act_fn"))
PROJECTIONS = tuple(f"{owner}.{name}" for owner, name in PARTS[:7])


def sliding_window(layer, cfg) -> int | None:
    """The sliding window the layer's attention passes to the attention function: Qwen2's per-layer attribute,
    Mistral's config field for every layer, none for Llama."""
    if hasattr(layer.self_attn, "sliding_window"):
        return layer.self_attn.sliding_window
    if type(layer).__module__.endswith("modeling_mistral"):
        return getattr(cfg, "sliding_window", None)
    return None


def _exact_class(module, module_path: str, name: str) -> bool:
    cls = getattr(type(module), "module_class", type(module))  # a KernelRMSNorm: the class it runs the kernel for
    return cls.__module__ == module_path and cls.__name__ == name


class KernelRMSNorm:
    """Mixed into a supported RMSNorm class by :func:`kernel_norms` (``module_class``: that class): bf16 CPU inputs
    without autograd run the fused layers' own RMSNorm (``kernels.cpu_decode_layer.rms_norm``: one call, bit for bit
    the module's output) instead of its eight operators, the prefills' norms included; anything else runs the
    class's own forward."""

    module_class: type

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (hidden_states.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and hidden_states.device.type == "cpu"
                and not torch.is_grad_enabled() and hidden_states.numel() > 0):
            shape = hidden_states.shape
            flat = hidden_states.reshape(-1, shape[-1])
            return cpu_decode_layer.rms_norm(flat, w, self.variance_epsilon).view(shape)
        return super().forward(hidden_states)


_KERNEL_CLASSES: dict[type, type] = {}


def kernel_norms(model) -> int:
    """Give every RMSNorm of ``model`` whose class is one of :data:`SUPPORTED`'s a :class:`KernelRMSNorm` class (in
    place; the modules keep their names and weights); returns how many changed. Why: in bf16 on a CPU torch runs the
    module's eight operators at a few microseconds each and, on a prefill's thousands of rows, far slower than one
    pass (``tests/test_fused_layers.py`` checks the outputs are the same bits)."""
    changed = 0
    norm_classes = {(path, names[5]) for path, names in SUPPORTED.items()}
    for module in model.modules():
        cls = type(module)
        if (cls.__module__, cls.__name__) in norm_classes:
            if cls not in _KERNEL_CLASSES:
                _KERNEL_CLASSES[cls] = type(f"Kernel{cls.__name__}", (KernelRMSNorm, cls), {"module_class": cls})
            module.__class__ = _KERNEL_CLASSES[cls]
            changed += 1
    return changed


def parts(layer) -> list[tuple]:
    """(registry, name, module) of each of :data:`PARTS` in ``layer``: the registry is the owner's ``_modules`` dict,
    which a module replaced later changes (read with a dict lookup, far cheaper than module attribute access)."""
    owners = {"": layer, "self_attn": layer.self_attn, "mlp": layer.mlp}
    return [(owners[owner]._modules, name, owners[owner]._modules[name]) for owner, name in PARTS]


def unsupported(model, attention_backend: str) -> str | None:
    """Why :class:`FusedDecoder` cannot run ``model``'s decode steps, or None when it can."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16):
        return "not a float32 or bf16 model on a CPU"
    if attention_backend != "cpp":
        return f"attention backend {attention_backend!r} (the fused layers call the 'cpp' backend's kernel)"
    names = SUPPORTED.get(type(model).__module__)
    base = getattr(model, "model", None)
    if names is None or not _exact_class(model, type(model).__module__, names[0]) \
            or not _exact_class(base, type(model).__module__, names[1]):
        return f"model {type(model).__name__} is not one of {sorted(v[0] for v in SUPPORTED.values())}"
    path = type(model).__module__
    cfg = model.config.get_text_config()
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return "hidden_act is not silu, or pretraining_tp != 1"
    if len(base.layers) != cfg.num_hidden_layers:
        return "the config's num_hidden_layers is not the number of layers"
    for i, layer in enumerate(base.layers):
        for where, module, name in (("", layer, names[2]), (".self_attn", layer.self_attn, names[3]),
                                    (".mlp", layer.mlp, names[4]),
                                    (".input_layernorm", layer.input_layernorm, names[5]),
                                    (".post_attention_layernorm", layer.post_attention_layernorm, names[5])):
            if not _exact_class(module, path, name):
                return f"model.layers.{i}{where} is a {type(module).__name__}, not transformers' {name}"
        act = layer.mlp.act_fn
        if not (type(act) is torch.nn.SiLU or _exact_class(act, "transformers.activations", "SiLUActivation")):
            return "the MLP's activation is not SiLU"
        why = _not_packed(layer, p.dtype)
        if why:
            return why
        if any(layer.get_submodule(sub).bias is not None for sub in PROJECTIONS[4:]):
            return "an MLP projection has a bias"
    if not cpu_decode_layer.available():
        return f"the kernel does not build here: {cpu_decode_layer.KERNEL.error}"
    return None


def _not_packed(layer, dtype) -> str | None:
    """Why ``layer``'s projections are not laid out for a fused call: float32, each on our panels
    (``prepack.pack_linears``); bf16, prepacked for oneDNN with q/k/v and gate/up each one product
    (``prepack.prepack_linears``: :func:`prepacked_weights`)."""
    if dtype == torch.float32:
        for sub in PROJECTIONS:
            if type(layer.get_submodule(sub)) is not PanelLinear:
                return f"{sub} is not packed (runner.prepack.pack_linears)"
        return None
    if prepacked_weights(layer) is None:
        return "the projections are not prepacked for oneDNN with q/k/v and gate/up grouped (runner.prepack)"
    return None


def prepacked_weights(layer, projections: list | None = None) -> tuple[list, list, list] | None:
    """A bf16 layer's prepacked weights for ``decode_layer_prepacked`` ([q/k/v product, o_proj, gate/up product,
    down_proj], [the q/k/v product's bias, o_proj's], and [the most rows its products run on AMX: ``AMX_MAX_ROWS``
    where all four weights can, else 0; the most they run with AVX512-BF16: ``BF16_MAX_ROWS`` where all four can,
    else 0], as ``runner.prepack.prepacked_product`` decides in the engine's steps), or None unless q/k/v and
    gate/up are each one oneDNN group in that order and o/down_proj are prepacked alone. ``projections``: the
    layer's :data:`PROJECTIONS` modules in that order, if the caller has them (a decode step reads these for every
    layer: module attribute lookups cost more)."""
    q, k, v, o, gate, up, down = projections or [layer.get_submodule(name) for name in PROJECTIONS]
    groups = []
    for members in ((q, k, v), (gate, up)):
        group = getattr(members[0], "group", None)
        if not (all(type(m) is GroupedLinear and m.group is group and m.index == i for i, m in enumerate(members))
                and group.layout == "onednn"):
            return None
        groups.append(group)
    if not all(type(m) is PrepackedLinear and hasattr(m, "packed_weight") for m in (o, down)):
        return None
    qkv, gate_up = groups
    amx_rows = cpu_amx_linear.AMX_MAX_ROWS if qkv.amx and o.amx and gate_up.amx and down.amx else 0
    bf16_rows = cpu_bf16_linear.BF16_MAX_ROWS if qkv.bf16 and o.bf16 and gate_up.bf16 and down.bf16 else 0
    return [qkv.packed, o.packed_weight, gate_up.packed, down.packed_weight], [qkv.bias, o.bias], [amx_rows, bf16_rows]


class FusedDecoder:
    """``model``'s decode steps, one C++ call per decoder layer (see the module docstring). Build it only where
    :func:`unsupported` is None."""

    def __init__(self, model):
        base = model.model
        cfg = model.config.get_text_config()
        self.base = base
        attn = base.layers[0].self_attn
        self.dims = [cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                     getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, attn.head_dim]
        self.layers = [dict(parts=[module for _, _, module in parts(layer)], scale=float(layer.self_attn.scaling),
                            window=sliding_window(layer, cfg)) for layer in base.layers]
        # every (registry, name, object) the fused call relies on, checked with dict lookups each step: the layers,
        # their parts, and the parameters of the projections and norms; kept as three columns (registries, names,
        # objects), which current() checks in C
        slots = [(base.layers._modules, str(i), layer) for i, layer in enumerate(base.layers)]
        for layer in base.layers:
            slots += [(layer._modules, "self_attn", layer.self_attn), (layer._modules, "mlp", layer.mlp)]
            for registry, name, module in parts(layer):
                slots.append((registry, name, module))
                if name != "act_fn":
                    slots += [(module._parameters, p, module._parameters.get(p)) for p in ("weight", "bias")]
        self.slot_columns = tuple(zip(*slots))
        self.prepacked = next(model.parameters()).dtype != torch.float32  # bf16: decode_layer_prepacked
        self.weights = [(lin, lin.weight) for spec in self.layers for lin in spec["parts"][:7]]
        # each layer's parameters for the kernel, read once (through nn.Module.__getattr__ they cost more than the
        # plain attributes; with the per-layer cache views below, a few tenths of a ms a step); current() vouches
        # for them. The panels and epsilons are read every step (plain attributes): packing again, e.g. by a second
        # runner, makes new panels.
        for spec in self.layers:
            *lins, norm_in, norm_post, _ = spec["parts"]
            spec["args"] = ([norm_in.weight, norm_post.weight], [lin.bias for lin in lins[:4]])
        self.forget_cache()  # kv_cache: the cache that kv_views, each layer's (K, V) views, were taken of
        # bf16: every layer's prepacked_weights (None where a layer has none), read again when layers were packed,
        # prepacked or grouped since (runner.prepack.GENERATION); current() vouches for the modules themselves
        self._prepacked, self._prepacked_at = None, None
        self.none = torch.zeros(0, dtype=torch.long)  # a step without decodes: their (empty) tables and seq_lens

    def forget_cache(self) -> None:
        """Drop the per-layer views of the KV cache (the runner calls it before allocating another: the views would
        keep the old cache's memory alive)."""
        self.kv_cache, self.kv_views = None, []

    def current(self) -> bool:
        """Whether the model is still what this decoder read: the same layers, projections, norms, activation and
        parameters (none replaced since), every projection's panels packed from its weight as it is now."""
        registries, names, objects = self.slot_columns
        if not (len(self.base.layers) == len(self.layers)
                and all(map(operator.is_, map(dict.get, registries, names), objects))):
            return False
        return self.prepacked or all(type(lin) is PanelLinear and w._version == getattr(lin, "packed_version", None)
                                     for lin, w in self.weights)

    def hidden_states(self, batch, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """The final norm's output at ``batch.logits_indices`` ((num_logits, hidden) in the model's dtype), or None
        when this step is not for the fused layers (a row of several tokens, a prefill, a chunk or a speculative
        verification, unless in bf16 with the ``cpp`` backend's prefill kernel; the support probe; more rows than the
        packed linears take; a module replaced or a weight edited since): then the caller runs the model's own
        forward. kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)."""
        m, data = batch.attn_metadata, batch.attn_metadata.data
        n = batch.input_ids.shape[0]
        if m.prefill_indices:  # rows of several tokens: only in bf16, on the cpp backend's prefill kernel
            fits = self.prepacked and getattr(data, "prefill_spans", None) is not None
        else:
            fits = len(m.decode_indices) == n and getattr(data, "decode_lens", None) is not None
        if not fits or m.probe_calls is not None or (n > PANEL_MAX_ROWS and not self.prepacked) or not self.current():
            return None
        # bf16: each layer's prepacked products, read again after any packing (prepacking again, e.g. by a second
        # runner, makes new ones); a layer no longer grouped and prepacked runs the model's own forward
        prepacked = None
        if self.prepacked:
            if self._prepacked_at != prepack.GENERATION:
                self._prepacked = [prepacked_weights(layer, spec["parts"][:7])
                                   for layer, spec in zip(self.base.layers, self.layers)]
                self._prepacked_at = prepack.GENERATION
            prepacked = self._prepacked
            if any(p is None for p in prepacked):
                return None
        x = self.base.embed_tokens(batch.input_ids)  # (n, hidden)
        cos, sin = self.base.rotary_emb(x[None], batch.positions[None])  # (1, n, head_dim) each
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        tables, lens = (data.decode_tables, data.decode_lens) if m.decode_indices else (self.none, self.none)
        prefills = (data.prefill_spans, data.prefill_tables, data.decode_rows) if m.prefill_indices else ()
        if kv_cache is not self.kv_cache:
            self.kv_cache, self.kv_views = kv_cache, [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(len(self.layers))]
        for i, (spec, (k_cache, v_cache)) in enumerate(zip(self.layers, self.kv_views)):
            norms, biases = spec["args"]
            *lins, norm_in, norm_post, _ = spec["parts"]
            eps = [float(norm_in.variance_epsilon), float(norm_post.variance_epsilon)]
            if prepacked is not None:
                x = cpu_decode_layer.decode_layer_prepacked(x, norms, eps, *prepacked[i], self.dims, cos, sin,
                                                            k_cache, v_cache, m.slot_mapping, tables, lens,
                                                            spec["scale"], spec["window"], *prefills)
                continue
            x = cpu_decode_layer.decode_layer(x, norms, eps, [lin.panels for lin in lins], biases, self.dims, cos,
                                              sin, k_cache, v_cache, m.slot_mapping, tables, lens, spec["scale"],
                                              spec["window"])
        return self.base.norm(x[batch.logits_indices])
