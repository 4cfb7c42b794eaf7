"""CUDA graphs for decode steps (``runner.cuda_graphs``) on a CPU: the padded replay without the recording.

``DecodeGraphs(runner, capture=False)`` runs exactly what a replay runs (the persistent buffers, the padding rows,
the metadata over the buffers) eagerly, so its tokens, its padding and its fallbacks are tested here; recording and
replaying on a GPU is ``tests/test_cuda.py``'s (``gpu-check``).
"""

from types import SimpleNamespace

import pytest
import torch

from minibatch import ModelRunner, Request, SamplingParams, SimClock, make_engine
from minibatch.models import load_model
from minibatch.reference import reference_outputs
from minibatch.runner.batch import PackedSequence, pack_sequences
from minibatch.runner.cuda_graphs import (DecodeGraphs, capture_sizes, graphs_unsupported, model_sliding_window,
                                         padded_size)

GREEDY = SamplingParams(ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-random-llama", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    vocab = min(model.config.vocab_size, 4096)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3, 12, 21)]
    reqs = [Request(f"r{i}", p, n, GREEDY, arrival_time_s=0.01 * i)
            for i, (p, n) in enumerate(zip(prompts, (8, 3, 12, 6, 10, 5, 9)))]
    return model, tok, reqs, reference_outputs(model, reqs)


def padded_runner(model, tok, **options):
    runner = ModelRunner(model, tok, attention_backend="triton")
    runner.decode_graphs = DecodeGraphs(runner, capture=False, **options)
    return runner


def test_capture_sizes_and_padding():
    assert capture_sizes(20) == [1, 2, 4, 8, 16]
    assert capture_sizes()[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes()[-1] == 256
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 64, 65)] == [1, 4, 8, 16, 24, 64, None]


def test_enforce_eager_reaches_the_runner_from_compare_serve_and_calibrate(tmp_path, monkeypatch, one_thread):
    """``--enforce-eager`` (vLLM's option): each command builds its runners with it (on a GPU: no decode graphs)."""
    from minibatch import runner as runner_module
    from minibatch.__main__ import main
    from minibatch.serving.launch import build_server
    from minibatch.sim import calibrate

    seen, init = [], runner_module.ModelRunner.__init__

    def spy(self, *args, **kw):
        init(self, *args, **kw)
        seen.append(self.graphs_unsupported)

    monkeypatch.setattr(runner_module.ModelRunner, "__init__", spy)
    main(["compare", "--model", "tiny-random-llama", "--num-requests", "2", "--max-output-len", "4", "--policies",
          "paged,spec", "--enforce-eager", "--no-reference", "--no-progress", "--figures-dir", ""])  # and the draft's
    build_server("tiny-random-llama", "spec", dict(n_slots=64), enforce_eager=True, start=False)[1].shutdown()
    stop = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("stop here"))  # noqa: E731
    monkeypatch.setattr(calibrate, "measure", lambda *a, **kw: [])
    monkeypatch.setattr(calibrate, "fit_profile", lambda *a, **kw: SimpleNamespace(meta={}, draft=None))
    monkeypatch.setattr(calibrate, "measure_draft", stop)  # (the target's and the draft's runners are built)
    with pytest.raises(RuntimeError, match="stop here"):
        calibrate.calibrate("tiny-random-llama", scale=0.1, enforce_eager=True, progress=False,
                            draft_model="tiny-random-llama")
    eager_profile = SimpleNamespace(model="tiny-random-llama", dtype="float32", meta={"enforce_eager": True})
    with pytest.raises(RuntimeError, match="stop here"):  # --draft-only: as its profile was measured
        calibrate.calibrate_draft(eager_profile, "tiny-random-llama", progress=False)
    assert len(seen) == 8 and set(seen) == {"enforce_eager=True"}  # compare 2, serve 2, calibrate 2, draft-only 2


def test_why_a_runner_records_no_graphs(tiny):
    model, tok, _, _ = tiny
    assert ModelRunner(model, tok, attention_backend="triton").graphs_unsupported == \
        "CUDA graphs need a CUDA device, not cpu"
    assert ModelRunner(model, tok, enforce_eager=True).decode_graphs is None
    on_gpu = dict(device=torch.device("cuda"), vocab_subset=None, model=model)
    assert "sizes its work on the host" in graphs_unsupported(
        SimpleNamespace(attention_backend=SimpleNamespace(name="sdpa", cuda_graphs=False), **on_gpu))
    triton = SimpleNamespace(name="triton", cuda_graphs=True)
    assert graphs_unsupported(SimpleNamespace(attention_backend=triton, **on_gpu)) is None
    assert "vocab_subset" in graphs_unsupported(SimpleNamespace(attention_backend=triton, **on_gpu | {
        "vocab_subset": torch.arange(3)}))
    softcap = SimpleNamespace(final_logit_softcapping=30.0)
    capped = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: softcap))
    assert "post-processes its logits (final_logit_softcapping)" in graphs_unsupported(
        SimpleNamespace(attention_backend=triton, **on_gpu | {"model": capped}))
    assert graphs_unsupported(SimpleNamespace(attention_backend=triton, **on_gpu), enforce_eager=True) == \
        "enforce_eager=True"


def test_sliding_window_of_a_model(tiny):
    model, _, _, _ = tiny
    assert model_sliding_window(model) is None
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=7)
    assert model_sliding_window(MistralForCausalLM(cfg)) == 7


@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_padded_decode_steps_match_hf_generate(tiny, policy):
    """7 requests decode as batches of up to 7, run padded to 8, 4, 2 or 1 rows: the same tokens as HF generate."""
    model, tok, reqs, refs = tiny
    runner = padded_runner(model, tok)
    done = [r.copy() for r in reqs]
    make_engine(policy, runner, SimClock(), max_num_seqs=8, block_size=4, n_slots=1024).generate(done)
    assert {r.request_id: r.output_token_ids for r in done} == refs
    graphs = runner.decode_graphs
    assert graphs.replays > 0 and graphs.disabled is None and set(graphs.graphs) <= {1, 2, 4, 8} and 8 in graphs.graphs


def decode_batch(runner, n: int, start: int = 10):
    seqs = [PackedSequence(f"r{i}", [5 + i], start, [2 * i, 2 * i + 1], 1) for i in range(n)]
    return pack_sequences(seqs, runner.kv_cache, runner.attention_backend)


def test_padding_rows_write_no_kv(tiny):
    """A padding row's slot is reset to -1 every step: the slot a larger batch left there would overwrite live K/V."""
    model, tok, _, _ = tiny
    runner = padded_runner(model, tok)
    runner.allocate_kv_cache(16, 8)
    graphs = runner.decode_graphs
    graphs.run(decode_batch(runner, 4))  # rows 0-3 write slots in blocks 0, 2, 4, 6
    before = runner.kv_cache.clone()
    graphs.buffers["slot_mapping"][3] = 7 * 8  # a stale slot in block 7, a block the next step does not own
    logits = graphs.run(decode_batch(runner, 3))  # 3 decodes, padded to 4
    assert logits.shape == (3, model.config.vocab_size)
    assert torch.equal(runner.kv_cache[:, :, 7], before[:, :, 7])
    assert graphs.buffers["slot_mapping"][3] == -1 and graphs.buffers["seq_lens"][3] == 1


def test_what_runs_eagerly(tiny):
    """More decodes than the largest size, a prefill, a context past a sliding window: None (the eager step);
    a new KV cache drops the graphs and buffers."""
    model, tok, _, _ = tiny
    runner = padded_runner(model, tok, max_size=2)
    runner.allocate_kv_cache(16, 8)
    graphs = runner.decode_graphs
    assert graphs.run(decode_batch(runner, 3)) is None
    assert graphs.run(decode_batch(runner, 2)) is not None and set(graphs.graphs) == {2}
    prefill = pack_sequences([PackedSequence("p", [5, 6, 7], 0, [0], 1)], runner.kv_cache, runner.attention_backend)
    assert graphs.run(prefill) is None
    runner.sliding_window = 8
    assert graphs.run(decode_batch(runner, 2, start=10)) is None  # contexts of 11 > 8
    runner.sliding_window = None
    runner.allocate_kv_cache(32, 8)
    assert graphs.graphs == {} and graphs.buffers is None
