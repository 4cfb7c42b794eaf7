"""Fused decode layers (minibatch/runner/fused_layers.py, kernels/cpu_decode_layer.cpp): an all-decode step of a
float32 Llama-family model as one C++ call per layer gives the modules' logits up to float32 rounding and HF
generate's greedy tokens, and of a bf16 one the modules' logits bit for bit; every step it does not apply to runs
the model's own forward; it is refused, with the reason, where it would not be the same computation."""

import pytest
import torch

from architectures import build_tiny_model, check_architecture
from minibatch.clock import SimClock
from minibatch.kernels import cpu_decode_layer
from minibatch.kernels.cpp_build import compiler_available
from minibatch.models import load_model
from minibatch.policies import make_engine
from minibatch.request import Request, SamplingParams
from minibatch.runner import ModelRunner, fused_layers, prepack

pytestmark = pytest.mark.skipif(not compiler_available(), reason="no C++ compiler to build the fused decode layer")


@pytest.fixture
def calls(monkeypatch):
    """The number of fused layer calls so far (both kernels wrapped: float32's and bf16's)."""
    count = [0]
    for name in ("decode_layer", "decode_layer_prepacked"):
        original = getattr(cpu_decode_layer, name)

        def counted(*args, original=original, **kwargs):
            count[0] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(cpu_decode_layer, name, counted)
    return count


def decoding_pair(model, n=3, policy="paged", **options):
    """Two runners on one model, fused and not, each with an engine (``policy``, with ``options``) holding the same
    n greedy requests; each runner's forward_packed records its logits (runner.logged)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (5 + 4 * i,), generator=g).tolist() for i in range(n)]
    engines = []
    for fuse in (True, False):
        runner = ModelRunner(model, attention_backend="cpp", fuse_decode_layers=fuse)
        runner.logged = []
        forward = runner.forward_packed

        def logged(batch, forward=forward, runner=runner):
            logits, ids = forward(batch)
            runner.logged.append((logits.clone(), ids))
            return logits, ids

        runner.forward_packed = logged
        engine = make_engine(policy, runner, SimClock(), **({"max_num_seqs": n, "block_size": 4, "n_slots": 256}
                                                            | options))
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"r{i}", p, 12, SamplingParams(ignore_eos=True)))
        engine.model_runner = runner  # the executor itself, or what a speculative executor verifies with
        engines.append(engine)
    return engines


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_fused_decode_steps_give_the_modules_logits(model_type, dtype, calls):
    """Step by step, on decodes of contexts longer than the sliding window (Mistral) and with q/k/v biases (Qwen2),
    the fused runner's logits equal the modules': in float32 up to float32 rounding of the small operators (the same
    packed products and attention kernel); in bf16 bit for bit (the modules' operators in their order and dtype on
    the same prepacked oneDNN products, q/k/v and gate/up grouped)."""
    model = build_tiny_model(model_type).to(dtype)
    if dtype == torch.bfloat16 and not prepack.can_prepack(model):
        pytest.skip("no oneDNN bf16 here: linears are not prepacked, so bf16 layers are not fused")
    fused, plain = decoding_pair(model)
    assert fused.executor.fused_decoder is not None and plain.executor.fused_decoder is None
    for engine in (fused, plain):
        engine.generate([])
    assert len(fused.executor.logged) == len(plain.executor.logged) >= 12
    for (a, ids_a), (b, ids_b) in zip(fused.executor.logged, plain.executor.logged):
        assert ids_a == ids_b
        if dtype == torch.bfloat16:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert calls[0] >= 11 * model.config.num_hidden_layers  # every decode step, every layer


@pytest.mark.parametrize("policy,options", [("chunked", dict(max_num_batched_tokens=8)), ("spec_ngram", {})])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_bf16_steps_with_prefills_give_the_modules_logits(model_type, policy, options, calls):
    """bf16 with the prefill kernel (``kernels.cpu_prefill``): steps with rows of several tokens run fused too,
    whole prompts, chunks extending a cached context mixed with decodes (chunked), verifications (spec_ngram), and
    give the modules' logits bit for bit (both attend with the same kernels)."""
    from minibatch.kernels import cpu_prefill

    model = build_tiny_model(model_type).to(torch.bfloat16)
    if not (prepack.can_prepack(model) and cpu_prefill.available()):
        pytest.skip("no oneDNN bf16 or no AVX512-BF16 here: prefill steps are not fused")
    fused, plain = decoding_pair(model, 3, policy, **options)
    steps = {}
    original = fused.model_runner.fused_decoder.hidden_states

    def counted(batch, kv_cache):
        out = original(batch, kv_cache)
        kind = "mixed" if batch.attn_metadata.prefill_indices and batch.attn_metadata.decode_indices else \
            "prefill" if batch.attn_metadata.prefill_indices else "decode"
        steps[kind] = steps.get(kind, 0) + (out is not None)
        return out

    fused.model_runner.fused_decoder.hidden_states = counted
    for engine in (fused, plain):
        engine.generate([])
    assert len(fused.model_runner.logged) == len(plain.model_runner.logged) >= 12
    for (a, ids_a), (b, ids_b) in zip(fused.model_runner.logged, plain.model_runner.logged):
        assert ids_a == ids_b and torch.equal(a, b)
    assert steps.get("prefill", 0) + steps.get("mixed", 0) > 0 and steps.get("decode", 0) > 0, steps
    if policy == "chunked":
        assert steps.get("mixed", 0) > 0, steps


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_fused_engine_matches_hf_generate(model_type, calls):
    """paged (every decode fused), chunked (decodes fused, chunks not) and spec_ngram (verification not fused):
    HF generate's greedy tokens."""
    result = check_architecture(model_type, ("paged", "chunked", "spec_ngram"), attention_backend="cpp")
    assert result.exact == {"paged": True, "chunked": True, "spec_ngram": True}
    assert calls[0] > 0


def test_smollm2_fused_decodes_match_hf_generate(calls):
    from minibatch.prompts import chat_prompt_ids, demo_prompts
    from minibatch.reference import reference_outputs

    model, tok = load_model("smollm2-135m", dtype="float32")
    reqs = [Request(f"r{i}", chat_prompt_ids(tok, text), 12, SamplingParams(ignore_eos=True), arrival_time_s=0.02 * i)
            for i, text in enumerate(demo_prompts()[:4])]
    refs = reference_outputs(model, reqs)
    runner = ModelRunner(model, tok, attention_backend="cpp")
    assert runner.fused_decoder is not None
    make_engine("paged", runner, SimClock(), max_num_seqs=4, n_slots=1024).generate(reqs)
    assert [r.output_token_ids for r in reqs] == [refs[r.request_id] for r in reqs]
    assert calls[0] >= 30 * 10  # 30 layers, every decode step


def test_smollm2_bf16_fused_decodes_give_the_modules_logits(calls):
    model, _ = load_model("smollm2-135m", dtype="bfloat16")
    if not prepack.can_prepack(model):
        pytest.skip("no oneDNN bf16 here: linears are not prepacked, so bf16 layers are not fused")
    fused, plain = decoding_pair(model, n=4)
    for engine in (fused, plain):
        engine.generate([])
    for (a, ids_a), (b, ids_b) in zip(fused.executor.logged, plain.executor.logged, strict=True):
        assert ids_a == ids_b and torch.equal(a, b)
    assert calls[0] >= 30 * 10
    decoder, layer, cache = fused.executor.fused_decoder, model.model.layers[0], fused.executor.kv_cache

    def call(x, slots=(0, 1), cos=torch.ones(2, 64, dtype=torch.bfloat16)):
        return cpu_decode_layer.decode_layer_prepacked(
            x, [layer.input_layernorm.weight] * 2, [1e-5] * 2, *fused_layers.prepacked_weights(layer), decoder.dims,
            cos, cos, cache[0, 0], cache[0, 1], torch.tensor(slots), torch.tensor([[0], [1]]), torch.tensor([1, 1]),
            0.125, None)

    x = torch.randn(2, decoder.dims[0]).to(torch.bfloat16)
    assert call(x).shape == x.shape
    with pytest.raises(RuntimeError, match="x \\(n, hidden\\)"):
        call(x[:, :-1])
    with pytest.raises(RuntimeError, match="cos and sin"):
        call(x, cos=torch.ones(2, 64))  # float32, not x's dtype
    before = cache.clone()
    with pytest.raises(RuntimeError, match="outside the cache"):  # checked before row 0's K/V is written
        call(x, slots=(2, 10 ** 9))
    assert torch.equal(cache, before)


def test_where_fused_layers_are_refused_and_why():
    fp32, _ = load_model("tiny-random-llama", dtype="float32")
    ModelRunner(fp32, attention_backend="cpp")  # packs the linears
    assert fused_layers.unsupported(fp32, "cpp") is None
    assert "attention backend 'torch'" in fused_layers.unsupported(fp32, "torch")
    assert ModelRunner(fp32, attention_backend="torch").fused_decoder is None
    bf16, _ = load_model("tiny-random-llama", dtype="bfloat16")
    assert "not prepacked for oneDNN" in fused_layers.unsupported(bf16, "cpp")
    if prepack.can_prepack(bf16):
        ungrouped, _ = load_model("tiny-random-llama", dtype="bfloat16")
        prepack.prepack_linears(ungrouped, fuse=False)  # q/k/v and gate/up not one product each: not the layer's
        assert "with q/k/v and gate/up grouped" in fused_layers.unsupported(ungrouped, "cpp")
        ModelRunner(bf16, attention_backend="cpp")  # prepacks and groups the linears
        assert fused_layers.unsupported(bf16, "cpp") is None
    fp16, _ = load_model("tiny-random-llama", dtype="float16")
    assert fused_layers.unsupported(fp16, "cpp") == "not a float32 or bf16 model on a CPU"
    assert "model Qwen3ForCausalLM is not one of" in fused_layers.unsupported(build_tiny_model("qwen3"), "cpp")

    class ScaledLlama(type(fp32)):  # a subclass may do more than transformers' forward (scale embeddings, ...)
        pass

    fp32.__class__ = ScaledLlama
    assert fused_layers.unsupported(fp32, "cpp").startswith("model ScaledLlama is not one of")
    runner = ModelRunner(fp32, attention_backend="cpp")
    assert runner.fused_decoder is None and runner.fused_unsupported.startswith("model ScaledLlama")
    gelu = build_tiny_model("llama")
    ModelRunner(gelu, attention_backend="cpp")
    gelu.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert fused_layers.unsupported(gelu, "cpp") == "the MLP's activation is not SiLU"
    unpacked = build_tiny_model("llama")
    assert "is not packed" in fused_layers.unsupported(unpacked, "cpp")
    assert ModelRunner(unpacked, attention_backend="cpp", prepack_weights=False).fused_decoder is None


def test_a_weight_edited_after_packing_runs_the_modules(calls):
    """The edited weight's layer has no fresh panels: the step runs the model's own forward (F.linear on the new
    weight) until the linears are packed again."""
    model = build_tiny_model("llama")
    fused, _ = decoding_pair(model)
    while fused.scheduler.waiting or fused.pending:
        fused.step()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    before = calls[0]
    fused.step()
    assert calls[0] == before


def test_bf16_layers_prepacked_again_are_read_again(calls):
    """Prepacking again (after a weight edit, or a second runner) makes new packed weights on the same modules: the
    fused decoder reads them again (``runner.prepack.GENERATION``), so its steps keep giving the modules' logits
    bit for bit, now those of the edited weight."""
    model = build_tiny_model("llama").to(torch.bfloat16)
    if not prepack.can_prepack(model):
        pytest.skip("no oneDNN bf16 here: linears are not prepacked, so bf16 layers are not fused")
    fused, plain = decoding_pair(model)
    for engine in (fused, plain):
        for _ in range(4):
            engine.step()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    prepack.prepack_linears(model)
    edited = len(fused.executor.logged)
    before = calls[0]
    for engine in (fused, plain):
        engine.generate([])
    assert calls[0] - before >= 6 * model.config.num_hidden_layers  # the fused layers ran after the edit
    assert len(fused.executor.logged) == len(plain.executor.logged) > edited
    for (a, _), (b, _) in zip(fused.executor.logged[edited:], plain.executor.logged[edited:]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("change", ["projection", "activation", "norm"])
def test_a_module_replaced_after_building_runs_the_modules(change, calls):
    """The fused decoder read the layers when the runner was built: a projection, activation or norm replaced since
    makes the step run the model's own forward (which calls the new module)."""
    model = build_tiny_model("llama")
    fused, _ = decoding_pair(model)
    while fused.scheduler.waiting or fused.pending:
        fused.step()
    layer = model.model.layers[1]
    if change == "projection":
        layer.mlp.up_proj = torch.nn.Linear(layer.mlp.up_proj.in_features, layer.mlp.up_proj.out_features, bias=False)
    elif change == "activation":
        layer.mlp.act_fn = torch.nn.GELU()
    else:
        layer.input_layernorm = type(layer.input_layernorm)(layer.input_layernorm.weight.shape[0])
    before = calls[0]
    fused.step()
    assert calls[0] == before


def test_the_kernel_checks_its_inputs():
    model = build_tiny_model("llama")
    runner = ModelRunner(model, attention_backend="cpp")
    spec, dims = runner.fused_decoder.layers[0], runner.fused_decoder.dims
    runner.allocate_kv_cache(8, 4)
    x = torch.randn(2, dims[0])
    cos = sin = torch.ones(2, dims[4])
    *lins, norm_in, norm_post, _ = spec["parts"]
    args = dict(norms=[norm_in.weight, norm_post.weight], eps=[norm_in.variance_epsilon, norm_post.variance_epsilon],
                panels=[lin.panels for lin in lins],
                biases=[None] * 4, dims=dims, cos=cos, sin=sin, k_cache=runner.kv_cache[0, 0],
                v_cache=runner.kv_cache[0, 1], slot_mapping=torch.tensor([0, 1]), tables=torch.tensor([[0], [1]]),
                seq_lens=torch.tensor([1, 1]), scale=0.25, window=None)
    out = cpu_decode_layer.decode_layer(x, **args)
    assert out.shape == x.shape and torch.isfinite(out).all()
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_decode_layer.decode_layer(x[:, :-1], **args)
    cache_before = runner.kv_cache.clone()
    with pytest.raises(RuntimeError, match="outside the cache"):  # checked before row 0's K/V is written
        cpu_decode_layer.decode_layer(x, **(args | dict(slot_mapping=torch.tensor([2, 10 ** 6]))))
    assert torch.equal(runner.kv_cache, cache_before)
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu_decode_layer.decode_layer(x, **(args | dict(cos=torch.ones(3, dims[4]))))


def test_a_new_kv_cache_drops_the_views_of_the_old_one():
    """The fused decoder keeps each layer's K/V views of the cache between steps; allocating another cache drops
    them first (they would keep the old cache's memory alive), and the next step takes views of the new one."""
    model = build_tiny_model("llama")
    runner = ModelRunner(model, attention_backend="cpp")
    engine = make_engine("paged", runner, SimClock(), max_num_seqs=2, block_size=4, n_slots=64)
    engine.add_request(Request("a", [5, 6, 7], 3, SamplingParams(ignore_eos=True)))
    engine.generate([])
    decoder = runner.fused_decoder
    assert decoder.kv_cache is runner.kv_cache and len(decoder.kv_views) == model.config.num_hidden_layers
    runner.allocate_kv_cache(32, 4)
    assert decoder.kv_cache is None and decoder.kv_views == []
    engine = make_engine("paged", runner, SimClock(), max_num_seqs=2, block_size=4, n_slots=128)
    request = Request("b", [5, 6, 7], 3, SamplingParams(ignore_eos=True))
    engine.add_request(request)
    engine.generate([])
    assert request.num_output_tokens == 3 and decoder.kv_cache is runner.kv_cache


def test_the_layers_silu_matches_torch_at_every_magnitude():
    """SiLU(g) * u as the fused layer computes it (e^-g on vector lanes where the CPU has them) is torch's within
    float32 rounding from tiny to overflowing gates, keeps NaN, gives torch's NaN at -inf and -0 where e^-g
    overflows, and is the same for an element whatever its position (a slice's tail runs through the lanes too)."""
    kernel = cpu_decode_layer.KERNEL.load()
    g = torch.cat([torch.randn(1000) * 10, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 87.0, -87.0,
                                                          88.5, -88.5, 89.0, -89.0, 100.0, -100.0, 1e30, -1e30,
                                                          float("inf"), float("-inf"), float("nan")])])
    u = torch.rand(g.shape) + 0.5
    got, want = kernel.silu_mul(g, u), torch.nn.functional.silu(g) * u
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-37, equal_nan=True)
    overflowing = (g < -100) & g.isfinite()
    assert torch.equal(torch.signbit(got[overflowing]), torch.signbit(want[overflowing]))
    for n in (1, 7, 9, 13, 1001):
        assert torch.equal(kernel.silu_mul(g[:n], u[:n]), got[:n])
    with pytest.raises(RuntimeError, match="one shape"):
        kernel.silu_mul(g, u[:-1])


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16 tensors equal bit for bit, NaN where the other's is NaN (its payload aside)."""
    nan = want.isnan()
    return (got.shape == want.shape and torch.equal(got.isnan(), nan)
            and torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)))


def test_the_bf16_layers_rotary_and_residual_add_are_the_modules_bit_for_bit():
    """The bf16 layer's rotary embedding (q cos + rotate_half(q) sin, each operator rounded to bf16) and residual
    add, on vector lanes with scalar tails, give transformers' and torch's numbers bit for bit: every head_dim whose
    half is or is not a multiple of the lanes, one row to a prefill's rows split over threads, tiny, huge, infinite
    and NaN values, and q read in place from the fused q/k/v product's strided rows."""
    from transformers.models.llama.modeling_llama import rotate_half

    kernel = cpu_decode_layer.KERNEL.load()
    g = torch.Generator().manual_seed(0)

    def mixed(*shape):
        scale = torch.tensor([1e-30, 1e-3, 1.0, 7.0, 1e30])[torch.randint(0, 5, shape, generator=g)]
        x = (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)
        flat = x.view(-1)
        flat[torch.randint(0, flat.numel(), (3,), generator=g)] = torch.tensor([float("inf"), -float("inf"),
                                                                                float("nan")], dtype=x.dtype)
        return x

    for n, heads, hd in ((1, 9, 64), (7, 3, 64), (5, 2, 80), (3, 4, 96), (2, 2, 128), (4, 1, 6), (300, 4, 64)):
        fused = mixed(n, (heads + 2) * hd)  # the q/k/v product's rows: q is a strided view of them
        q = fused[:, : heads * hd].view(n, heads, hd)
        angle = torch.rand(n, hd // 2, generator=g) * 100
        cos = torch.cat([angle.cos(), angle.cos()], -1).to(torch.bfloat16)
        sin = torch.cat([angle.sin(), angle.sin()], -1).to(torch.bfloat16)
        want = q * cos[:, None] + rotate_half(q) * sin[:, None]
        assert (n == 1 or not q.is_contiguous()) and same_bits(kernel.rotary_like_modules(q, cos, sin), want), n
        assert same_bits(kernel.rotary_like_modules(q.contiguous(), cos, sin), want)
    for count in (1, 15, 16, 17, 576 * 32 + 5, 300_001):
        x, y = mixed(count), mixed(count)
        assert same_bits(kernel.add_like_modules(x, y), x + y), count
    for hd in (5, 0):
        with pytest.raises(RuntimeError, match="head_dim must be even and positive"):
            kernel.rotary_like_modules(*(torch.ones(shape, dtype=torch.bfloat16) for shape in ((2, 1, hd), (2, hd),
                                                                                            (2, hd))))
    with pytest.raises(RuntimeError, match="add_like_modules: x and y"):
        kernel.add_like_modules(mixed(4), mixed(5))


def test_the_bf16_layers_rms_norm_is_the_modules_bit_for_bit():
    """The bf16 layer's RMSNorm (torch's mean of the float32 squares, summed in torch's order without calling it
    where that order is found, the elementwise steps as loops) gives transformers' LlamaRMSNorm output bit for bit,
    at every magnitude and row width, with zeros, infinities and NaN."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kernel = cpu_decode_layer.KERNEL.load()
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-30, 1e-6, 1.0, 3.0, 1e6, 1e18]).repeat_interleave(4)[:, None]
    x = (torch.randn(len(scales), 576, generator=g) * scales).to(torch.bfloat16)
    x = torch.cat([x, torch.zeros(1, 576, dtype=torch.bfloat16), x[:3].clone()])
    x[-3, 5], x[-2, 7], x[-1, 9] = float("inf"), float("nan"), -float("inf")
    for eps in (1e-5, 1e-6):
        norm = LlamaRMSNorm(576, eps=eps).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_((torch.randn(576, generator=g) * 0.5 + 1).to(torch.bfloat16))
            want = norm(x)
        got = kernel.rms_norm_like_modules(x, norm.weight.detach(), eps)
        assert same_bits(got, want) and got.isnan().any()  # NaN where torch's is (any payload)
    prefill = (torch.randn(3, 1100, 576, generator=g) * 4).to(torch.bfloat16)  # rows split over threads
    with torch.no_grad():
        want = norm(prefill)
        assert fused_layers.kernel_norms(torch.nn.ModuleList([norm])) == 1 and isinstance(norm, LlamaRMSNorm)
        assert type(norm).__name__ == "KernelLlamaRMSNorm"
        assert torch.equal(norm(prefill).view(torch.int16), want.view(torch.int16))
    assert norm(prefill).requires_grad  # with autograd on: the module's own operators
    for d in (1, 7, 8, 17, 64, 100, 960, 2048, 4097, 8192, 20000):  # torch's sum order at every width
        x = (torch.randn(5, d, generator=g) * torch.rand(5, d, generator=g) * 30).to(torch.bfloat16)
        norm = LlamaRMSNorm(d, eps=1e-5).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_((torch.randn(d, generator=g) * 0.5 + 1).to(torch.bfloat16))
            want = norm(x)
        for rows in (x, x[:1]):
            got = kernel.rms_norm_like_modules(rows, norm.weight.detach(), 1e-5)
            assert torch.equal(got.view(torch.int16), want[: len(rows)].view(torch.int16)), d
        assert kernel.row_sum_mode(d) in (0, 8, 16)
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # there torch's mean is our sum's (no call into torch)
        assert kernel.row_sum_mode(576) != 0 and kernel.row_sum_mode(40000) == 0
    with pytest.raises(RuntimeError, match="rms_norm_like_modules: x"):
        kernel.rms_norm_like_modules(prefill, norm.weight.detach(), 1e-5)
