"""Does a model really run the packed attention? A behavioural check, once per model, and the
attention geometry and context limit its config gives (``config_int``, ``config_max_model_len``).

``models.set_attention`` asks transformers to use our attention; a model that does not dispatch
through ``AttentionInterface`` keeps its own (transformers only logs it), a model whose layers
drop ``**kwargs`` never hands ``attn_metadata`` over, and a model with recurrent or convolutional
layers mixes the packed requests outside attention. None of that shows in the code we call, so we
run the model and compare (a class-name allowlist would only repeat what we believe):

    packed, two forwards over a small temporary KV cache (block_size 4):
      step 1:  | A: 12 prefill tokens          | B: 6 prefill tokens |
      step 2:  | A: 1 decode |  B: 3 tokens after its 6 cached ones  |
    alone:   A (13 tokens) and B (9 tokens), each one forward through the model's own attention

Every position's logits must agree (``tolerance``). That covers what packing relies on: requests
isolated from each other, positions, the KV cache written and read back, the decode path, a
chunk after cached context, and a sliding window shorter than the rows (if the model has one).
The check always uses the torch backend; the triton kernels are tested against it on their own.
"""

from __future__ import annotations

import torch

from minibatch.models import attention_implementation
from minibatch.runner import attention
from minibatch.runner.batch import PackedSequence, pack_sequences

# Config fields that hold a model's context limit (its position table or trained length), tried in
# this order. A config with none of them (ALiBi, no position table) gets NO_POSITION_LIMIT: positions
# then set no limit, KV memory does.
MAX_MODEL_LEN_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
                        "max_seq_len")
NO_POSITION_LIMIT = 1 << 20


def config_max_model_len(cfg) -> int:
    """The context limit of a model config: the first of MAX_MODEL_LEN_FIELDS set to an int >= 1,
    else NO_POSITION_LIMIT."""
    for name in MAX_MODEL_LEN_FIELDS:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value >= 1:
            return value
    return NO_POSITION_LIMIT


def config_int(model, cfg, name: str, default: int | None = None) -> int:
    """``cfg.<name>`` (an int >= 1), else ``default``; NotImplementedError naming the model class when
    there is neither (not a transformer decoder with one attention geometry for all layers)."""
    try:
        value = getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 -- e.g. a per-layer field that has no single value
        value = None
    if isinstance(value, int) and value >= 1:
        return value
    if default is None:
        raise NotImplementedError(f"{type(model).__name__} is not supported: its config has no single {name} "
                                  "(the packed KV cache needs one attention geometry for all layers)")
    return default


VERDICT_ATTR = "_minibatch_packed_support"  # on the model: "" = supported, else the refusal message
ROW_LENS = (13, 9)  # the two rows' tokens (A, B)
STEPS = (((0, 12), (0, 6)), ((12, 13), (6, 9)))  # per step, each row's [start, end) tokens
BLOCK_SIZE = 4


def tolerance(dtype: torch.dtype) -> float:
    """Largest allowed |packed - alone| logit difference, relative to max(1, max |logit|).

    Rounding alone gives ~1e-6 in fp32 and, over SmolLM2's 30 layers, ~3e-3 in fp16 and ~2e-2 in
    bf16 (our attention computes in fp32, the model's own in the model's dtype); what the check
    catches (rows seeing each other, a window or an option ignored) is ~0.3 to 1.
    """
    return {torch.float16: 2e-2, torch.bfloat16: 1e-1}.get(dtype, 1e-3)


def check_packed_support(model, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
    """Raise NotImplementedError unless ``model`` runs the packed attention exactly (see the module).

    The verdict is cached on the model (attribute ``VERDICT_ATTR``), so building several runners on
    one model runs the check once. The model's attention implementation and the caller's RNG are
    left as they were.

    Raises:
        NotImplementedError: "<ModelClass> is not supported by the packed attention: <why>".
    """
    verdict = getattr(model, VERDICT_ATTR, None)
    if verdict is None:
        attention.register()
        verdict = _why_unsupported(model, num_layers, num_kv_heads, head_dim)
        setattr(model, VERDICT_ATTR, verdict)
    if verdict:
        raise NotImplementedError(f"{type(model).__name__} is not supported by the packed attention: {verdict}")


@torch.inference_mode()
def _why_unsupported(model, num_layers: int, num_kv_heads: int, head_dim: int) -> str:
    """The reason the packed forward differs from the rows alone, or "" when it does not."""
    from transformers.utils import logging as hf_logging

    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)  # local: the caller's RNG stream is untouched
    rows = [torch.randint(0, model.config.get_text_config().vocab_size, (n,), generator=g).tolist() for n in ROW_LENS]
    own = model.config._attn_implementation
    if own == attention.ATTN_IMPLEMENTATION:
        own = "eager"
    try:
        with attention_implementation(model, own):
            alone = [model(input_ids=torch.tensor([r], device=device), use_cache=False).logits[0].float() for r in rows]
    except Exception as e:  # noqa: BLE001 -- any failure means we cannot vouch for it
        return f"its own attention ({own!r}) failed on a plain forward ({type(e).__name__}: {e})"

    num_blocks = sum(-(-n // BLOCK_SIZE) for n in ROW_LENS)
    kv_cache = torch.zeros((num_layers, 2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), dtype=dtype, device=device)
    tables = [list(range(0, num_blocks, 2)), list(range(1, num_blocks, 2))]  # interleaved blocks: A 0 2 4 6, B 1 3 5
    calls: list[int] = []  # layer_idx of every attention call of one forward
    packed: list[list[torch.Tensor]] = [[], []]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a model that cannot switch logs it: the verdict says it instead
    try:
        with attention_implementation(model, attention.ATTN_IMPLEMENTATION):
            for step in STEPS:
                seqs = [PackedSequence(f"row{i}", rows[i][a:b], a, tables[i], 0) for i, (a, b) in enumerate(step)]
                batch = pack_sequences(seqs, kv_cache, "torch")
                batch.attn_metadata.probe_calls = calls
                logits = model(input_ids=batch.input_ids[None], position_ids=batch.positions[None],
                               attn_metadata=batch.attn_metadata, use_cache=False).logits[0].float()
                if not calls:
                    return (f"its attention does not dispatch through transformers' AttentionInterface "
                            f"(it kept {model.config._attn_implementation!r})")
                repeated = sorted({layer for layer in calls if calls.count(layer) > 1})
                if repeated:
                    return (f"it calls the attention function more than once per forward in layers {repeated} "
                            "(the KV cache holds one K/V per layer)")
                calls.clear()
                cu = batch.attn_metadata.cu_seqlens_q
                for i in range(2):
                    packed[i].append(logits[cu[i]:cu[i + 1]])
    except attention.MissingAttnMetadata:
        return "attn_metadata did not reach the attention function (its layers do not pass their keyword arguments on)"
    except NotImplementedError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001
        return f"the packed forward failed ({type(e).__name__}: {e})"
    finally:
        hf_logging.set_verbosity(verbosity)
    tol = tolerance(dtype)
    errors = []
    for i in range(2):
        got, want = torch.cat(packed[i]), alone[i]
        errors.append((got - want).abs().max().item() / max(1.0, want.abs().max().item()))
    if all(e <= tol for e in errors):
        return ""
    error = f"relative logit error {max(errors):.2g} > {tol:g}"
    if errors[0] <= tol:  # the first row has nothing packed before it: only the second sees a neighbour
        return f"packed rows see each other ({error})"
    return (f"its packed logits differ from the rows run alone ({error}): something besides the attention "
            "function sees the whole row or masks it (recurrent or convolutional layers, a mask-only sliding "
            "window, ...)")
