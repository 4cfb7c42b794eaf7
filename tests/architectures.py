"""Tiny random-weight models of the decoder architectures transformers ships, built offline.

Shared by the support test (``tests/test_architectures.py``) and the README's support table
(``tests/support_table.py``). Every ``model_type`` gets the same small shape where its config
has the field: 2 layers, hidden 64, 4 query / 2 KV heads (head_dim 16), vocab 512, 256 positions,
MoE with 4 experts (2 per token) and a sliding window of ``SLIDING_WINDOW`` tokens (the test's rows
are longer, so the window matters); models mixing layer kinds get one sliding and one full layer.
``initializer_range`` 0.2 spreads the random logits so greedy decoding has no near-ties (see
``models._random_config``). Weights are seeded: the same model on every build.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Decoder-only text architectures (transformers ``model_type``), grouped by how they attend.
ARCHITECTURES = (
    # rotary, (grouped-query) attention through AttentionInterface
    "llama", "mistral", "mixtral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma3_text",
    "phi", "phi3", "olmo", "olmo2", "olmo3", "olmoe", "granite", "granitemoe", "gpt_neox", "starcoder2", "cohere",
    "cohere2", "persimmon", "helium", "glm", "glm4", "glm4_moe", "smollm3", "exaone4", "seed_oss", "arcee",
    "apertus", "hunyuan_v1_dense", "ernie4_5", "bitnet", "gptj", "codegen",
    # learned or sinusoidal positions
    "gpt2", "gpt_bigcode", "opt", "biogpt", "ctrl",
    # options, layouts or layers the packed attention does not implement
    "gemma2", "vaultgemma", "gpt_oss", "granite_swa", "phimoe", "diffllama", "doge", "jetmoe", "deepseek_v3",
    "stablelm", "nemotron", "falcon", "gpt_neo", "bloom", "mpt", "xglm", "openai-gpt", "lfm2", "mamba",
)
SLIDING_WINDOW = 8
SEED = 0

COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
    sliding_window=SLIDING_WINDOW, use_sliding_window=True, max_window_layers=0,
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, attention_dropout=0.0, hidden_dropout=0.0,
)
# Fields of one architecture that COMMON does not cover (or must not set).
OVERRIDES = {
    "gptj": dict(rotary_dim=8),  # rotary_dim must fit head_dim
    "codegen": dict(rotary_dim=8),
    "gpt_bigcode": dict(num_key_value_heads=1),  # multi-query attention (its default)
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=SLIDING_WINDOW),
    "deepseek_v3": dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        head_dim=8, n_group=1, topk_group=1, first_k_dense_replace=1),
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # a short-convolution layer, then attention
}
MIXED_LAYER_TYPES = ["sliding_attention", "full_attention"]


def tiny_config(model_type: str):
    """The small config of ``model_type`` (a transformers ``model_type``, e.g. "llama").

    Only fields the architecture's config knows are set (COMMON, then OVERRIDES). A config whose
    layer_types include sliding-attention layers gets one sliding and one full layer.

    Raises:
        ValueError: ``model_type`` is unknown to the installed transformers.
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"model_type {model_type!r} is not in this transformers' CONFIG_MAPPING")
    default = AutoConfig.for_model(model_type)
    known = set(default.to_dict()) | set(getattr(type(default), "attribute_map", {}))
    fields = {k: v for k, v in COMMON.items() if k in known}
    fields.update(OVERRIDES.get(model_type, {}))
    config = AutoConfig.for_model(model_type, **fields)
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types and set(layer_types) <= set(MIXED_LAYER_TYPES):
        config = AutoConfig.for_model(model_type, **fields, layer_types=MIXED_LAYER_TYPES)
    return config


def build_tiny_model(model_type: str):
    """``AutoModelForCausalLM.from_config(tiny_config(model_type))`` with seeded weights, in eval mode
    with gradients off; the caller's RNG stream is untouched. Raises like ``tiny_config``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = tiny_config(model_type)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = AutoModelForCausalLM.from_config(config)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------- the support check

POLICIES = ("static", "orca", "paged", "chunked", "spec_ngram")
PROMPT_LENS = (11, 19, 26)  # all longer than SLIDING_WINDOW
MAX_NEW_TOKENS = (12, 8, 16)
CHUNK_BUDGET = 8  # chunked: tokens per step, so every prompt is prefilled in several chunks
# each policy's options in the check: small KV blocks (paged), small chunks (chunked)
POLICY_OPTIONS = {"paged": dict(block_size=4), "chunked": dict(block_size=4, max_num_batched_tokens=CHUNK_BUDGET),
                  "spec_ngram": dict(block_size=4)}


@dataclass
class SupportResult:
    """One architecture's verdict.

    refused: the NotImplementedError message of ``ModelRunner(model)``, or None if it loaded.
    exact: policy -> whether every request's greedy tokens equal HF ``generate`` on it alone.
    num_draft_tokens: draft tokens proposed under spec_ngram (> 0: verification was exercised).
    """

    model_type: str
    hf_class: str
    refused: str | None = None
    exact: dict[str, bool] = field(default_factory=dict)
    num_draft_tokens: int = 0



def support_requests(model, seed: int = SEED) -> list:
    """Greedy ``ignore_eos`` requests with prompts of PROMPT_LENS tokens: 4 random tokens, then the
    model's own greedy continuation of them. Decoding goes on along that greedy path, and a tiny
    random model's greedy path soon repeats itself, so n-gram lookup finds drafts to verify."""
    from minibatch.request import Request, SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab_size = model.config.get_text_config().vocab_size
    requests = []
    for i, (n, max_new) in enumerate(zip(PROMPT_LENS, MAX_NEW_TOKENS)):
        ids = torch.randint(3, vocab_size, (1, 4), generator=g)
        with torch.inference_mode():
            for _ in range(n - 4):  # greedy, no cache: a few tokens of a tiny model
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
        requests.append(Request(f"r{i}", ids[0].tolist(), max_new, SamplingParams(ignore_eos=True)))
    return requests


def check_architecture(model_type: str, policies=POLICIES, attention_backend: str = "torch") -> SupportResult:
    """Build the tiny ``model_type``, load it into a ModelRunner with ``attention_backend`` and, unless refused,
    run ``support_requests`` under each policy (simulated clock) against HF ``generate`` (greedy, each request
    alone)."""
    from minibatch.reference import reference_outputs
    from minibatch.policies import make_engine
    from minibatch.runner.model_runner import ModelRunner
    from minibatch.clock import SimClock

    model = build_tiny_model(model_type)
    result = SupportResult(model_type, type(model).__name__)
    try:
        runner = ModelRunner(model, attention_backend=attention_backend)
    except NotImplementedError as e:
        result.refused = str(e)
        return result
    requests = support_requests(model)
    refs = reference_outputs(model, requests)
    for policy in policies:
        engine = make_engine(policy, runner, SimClock(), config={"n_slots": 512}, **POLICY_OPTIONS.get(policy, {}))
        done = engine.generate([r.copy() for r in requests])
        result.exact[policy] = all(r.output_token_ids == refs[r.request_id] for r in done)
        spec = engine.executor.make_stats().get("spec_decoding")
        if spec is not None:
            result.num_draft_tokens = spec["num_draft_tokens"]
    return result
