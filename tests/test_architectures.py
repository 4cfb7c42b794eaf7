"""Every decoder architecture is exact or refused: never silently wrong.

Small random configs of the decoder-only architectures transformers ships (``tests/architectures.py``:
2 layers, hidden 64, vocab 512, sliding windows of 8 tokens, rows longer than that) are either
token-exact with HF ``generate`` under static, orca, paged, chunked and spec_ngram, or refused with
NotImplementedError when their ModelRunner is built (the behavioural check of ``runner.support``).
Also here: the attention function's keyword checks, the sliding window, the check's bookkeeping,
and static batching on a learned-position model whose padded batch outgrows its position table.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import CONFIG_MAPPING, GPT2Config, GPT2LMHeadModel
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

from minibatch import ModelRunner, Request, SamplingParams
from architectures import ARCHITECTURES, POLICIES, SLIDING_WINDOW, build_tiny_model, check_architecture
from minibatch.baselines import run_hf_generate
from minibatch.reference import reference_outputs
from minibatch.models import load_model
from minibatch.policies import make_engine
from minibatch.runner import attention, support
from minibatch.runner.backends.torch_ref import sliding_window_attention
from minibatch.runner.batch import PackedSequence, pack_sequences
from minibatch.runner.support import NO_POSITION_LIMIT, config_max_model_len
from minibatch.clock import SimClock

pytestmark = pytest.mark.usefixtures("one_thread")

# Architectures known to be exact (and those with a sliding window): the check must not refuse them.
MUST_BE_EXACT = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi", "phi3", "olmo2", "granite", "gpt_neox", "opt",
                 "gpt_bigcode", "gpt2", "mixtral", "starcoder2", "gemma3_text", "cohere2")
# Models once silently wrong or refused with a misleading message, with the reason the refusal must give.
MUST_BE_REFUSED = {
    "falcon": "does not dispatch through transformers' AttentionInterface",
    "bloom": "does not dispatch through transformers' AttentionInterface",
    "stablelm": "attn_metadata did not reach the attention function",
    "gemma2": "softcap",
    "gpt_oss": "s_aux",
}


def test_enough_architectures():
    assert len([t for t in ARCHITECTURES if t in CONFIG_MAPPING]) >= 25


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_exact_or_refused(model_type):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type!r}")
    result = check_architecture(model_type)
    if result.refused is not None:
        assert result.refused.startswith(f"{result.hf_class} is not supported")
        assert model_type not in MUST_BE_EXACT, result.refused
        assert MUST_BE_REFUSED.get(model_type, "") in result.refused
    else:
        assert model_type not in MUST_BE_REFUSED
        assert result.exact == dict.fromkeys(POLICIES, True)
        assert result.num_draft_tokens > 0  # spec_ngram really verified drafts


# full attention, sliding windows (mistral, qwen2), mixed layer kinds (gemma3_text), GQA (qwen3), learned positions
FAST_BACKEND_MODELS = ("llama", "mistral", "qwen2", "gemma3_text", "qwen3", "gpt2")


@pytest.mark.parametrize("model_type,backend", [(m, "sdpa") for m in FAST_BACKEND_MODELS]
                         + [("llama", "compiled"), ("mistral", "compiled")]
                         + [(m, "cpp") for m in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")])
def test_the_fast_backends_are_exact(model_type, backend):
    """The fast backends (sdpa: whole-block K/V reads, fused SDPA in the model's dtype; compiled: its decode
    compiled to read K/V through the block table; cpp: a C++ decode kernel reading K/V through the block table)
    give HF generate's tokens under the packed policies: decodes,
    prefills with nothing cached, chunks extending a cached context, verification; sliding windows included."""
    result = check_architecture(model_type, ("paged", "chunked", "spec_ngram"), attention_backend=backend)
    assert result.refused is None and result.exact == {"paged": True, "chunked": True, "spec_ngram": True}


# ----------------------------------------------------------------------------- negative control

class BypassingAttention(LlamaAttention):
    """Llama's attention computing SDPA itself over the whole row, never calling the attention
    interface: packed requests would attend to each other."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # (B, num_heads, T, head_dim)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)  # (B, num_kv_heads, T, head_dim)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


def test_model_bypassing_our_attention_is_refused():
    model, _ = load_model("tiny-random-llama")
    for layer in model.model.layers:
        layer.self_attn.__class__ = BypassingAttention
    with pytest.raises(NotImplementedError, match="LlamaForCausalLM .*does not dispatch through transformers' "
                                                  "AttentionInterface"):
        ModelRunner(model)


# ----------------------------------------------------------------------------- the check's bookkeeping

def test_check_runs_once_per_model_and_leaves_it_as_it_was(monkeypatch):
    model, tok = load_model("tiny-random-gpt2")
    implementation = model.config._attn_implementation
    calls = []
    real = support._why_unsupported
    monkeypatch.setattr(support, "_why_unsupported", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    ModelRunner(model, tok)
    assert torch.equal(torch.rand(3), expected)  # the caller's RNG stream is untouched
    ModelRunner(model, tok)
    assert len(calls) == 1
    assert model.config._attn_implementation == implementation


def test_refusal_is_cached_too():
    model = build_tiny_model("falcon")
    for _ in range(2):
        with pytest.raises(NotImplementedError, match="FalconForCausalLM"):
            ModelRunner(model)
    assert getattr(model, support.VERDICT_ATTR)


def test_max_model_len_falls_back_over_config_fields():
    class Config:
        pass

    cfg = Config()
    assert config_max_model_len(cfg) == NO_POSITION_LIMIT  # no position table (ALiBi): no position limit
    cfg.seq_length = 300
    assert config_max_model_len(cfg) == 300
    cfg.n_positions = 100
    assert config_max_model_len(cfg) == 100
    cfg.max_position_embeddings = None
    assert config_max_model_len(cfg) == 100
    assert ModelRunner(load_model("tiny-random-gpt2")[0]).max_model_len == 512  # GPT-2's n_positions


# ----------------------------------------------------------------------------- the attention function

class _Module(torch.nn.Module):
    layer_idx = 0


def _call(backend="torch", seq_len=6, **kwargs):
    """packed_attention_forward on one 6-token prefill (2 heads, 1 KV head, head_dim 4)."""
    kv = torch.zeros((1, 2, 4, 4, 1, 4))
    batch = pack_sequences([PackedSequence("a", list(range(seq_len)), 0, [0, 1], 1)], kv, backend)
    q = torch.randn(1, 2, seq_len, 4)
    k, v = torch.randn(1, 1, seq_len, 4), torch.randn(1, 1, seq_len, 4)
    return attention.packed_attention_forward(_Module(), q, k, v, None, attn_metadata=batch.attn_metadata, **kwargs)


@pytest.mark.parametrize("option, value", [("s_aux", torch.zeros(2)), ("softcap", 50.0), ("is_causal", False),
                                           ("dropout", 0.1), ("some_new_option", 3)])
def test_attention_refuses_options_it_does_not_implement(option, value):
    with pytest.raises(NotImplementedError, match=f"{option}=.*attention module _Module"):
        _call(**{option: value})


def test_attention_accepts_harmless_options():
    out, weights = _call(position_ids=torch.arange(6)[None], use_cache=False, output_router_logits=False,
                         output_attentions=False, is_causal=True, dropout=0.0, sliding_window=None, softcap=None,
                         some_new_option=None)
    assert out.shape == (1, 6, 2, 4) and weights is None


def test_attention_without_metadata_says_so():
    with pytest.raises(attention.MissingAttnMetadata, match="attn_metadata"):
        attention.packed_attention_forward(_Module(), torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4),
                                           torch.randn(1, 1, 3, 4), None)


def test_triton_backend_refuses_a_window_shorter_than_the_context():
    with pytest.raises(NotImplementedError, match="sliding_window=4"):
        _call("triton", seq_len=6, sliding_window=4)


def test_sliding_window_attention_masks_keys_older_than_the_window():
    """Query at position i sees key j iff 0 <= i - j < window (transformers' sliding-window mask)."""
    torch.manual_seed(0)
    seq_len, q_len, window = 9, 4, 3
    q, k, v = torch.randn(q_len, 2, 4), torch.randn(seq_len, 1, 4), torch.randn(seq_len, 1, 4)
    out = sliding_window_attention(q, k, v, 0.5, window)
    for row, i in enumerate(range(seq_len - q_len, seq_len)):
        keys = [j for j in range(seq_len) if 0 <= i - j < window]
        weights = torch.softmax(0.5 * q[row] @ k[keys, 0].T, dim=-1)  # (num_heads, len(keys))
        torch.testing.assert_close(out[row], weights @ v[keys, 0])


def test_rows_longer_than_the_window():
    assert min(len(r.prompt_token_ids) for r in _requests_for("mistral")) > SLIDING_WINDOW


def _requests_for(model_type):
    from architectures import support_requests

    return support_requests(build_tiny_model(model_type))


# ----------------------------------------------------------------------------- learned positions, static batches

def _short_gpt2(n_positions=32):
    config = GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=n_positions,
                        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2LMHeadModel(config).eval().requires_grad_(False)


def _fitting_requests():
    """Each fits 32 positions alone (24 and 31 tokens), but padded together 20 + 28 = 48 do not."""
    g = torch.Generator().manual_seed(3)
    return [Request(rid, torch.randint(3, 512, (n,), generator=g).tolist(), max_new, SamplingParams(ignore_eos=True))
            for rid, n, max_new in (("long-prompt", 20, 4), ("long-output", 3, 28))]


def test_static_batch_on_learned_positions_stays_in_the_position_table():
    model = _short_gpt2()
    reqs = _fitting_requests()
    refs = reference_outputs(model, reqs)
    done = make_engine("static", ModelRunner(model), SimClock()).generate([r.copy() for r in reqs])
    assert {r.request_id: r.output_token_ids for r in done} == refs


def test_hf_generate_batches_fit_the_position_table():
    model = _short_gpt2()
    reqs = _fitting_requests()
    refs = reference_outputs(model, reqs)
    done = run_hf_generate(model, [r.copy() for r in reqs], batch_size=8, max_wait_s=0.0)
    assert {r.request_id: r.output_token_ids for r in done} == refs
    assert done[0].first_scheduled_time_s < done[1].first_scheduled_time_s  # two batches: together they would not fit
