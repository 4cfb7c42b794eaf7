"""What only a CUDA GPU can show (every test here is marked ``cuda``: skipped without a GPU, run by
``python -m minibatch gpu-check`` with the Triton kernels compiled).

The engine on the GPU, token for token against HF ``generate`` on the same GPU: both attention
backends, preemption by swap (KV blocks really cross PCIe to CPU memory and back), parallel sampling
with copy-on-write, the full-size SmolLM2-shaped model (its 9 query / 3 KV heads of 64 dims go through
the compiled kernels), and the wall clock synchronizing with the device.
"""

import pytest
import torch

from minibatch import ModelRunner, Request, SamplingParams, SimClock, WallClock, make_engine
from minibatch.models import load_model
from minibatch.reference import reference_outputs
from minibatch.request import fork_requests

pytestmark = pytest.mark.cuda
GREEDY = SamplingParams(ignore_eos=True)
PROMPT_LENS, MAX_NEW = [5, 17, 9, 30, 3, 12, 21, 40], [8, 3, 12, 6, 10, 5, 9, 20]


def cuda_setup(name, dtype=torch.float32):
    model, tok = load_model(name, device="cuda", dtype=dtype)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, min(model.config.vocab_size, 4096), (n,), generator=g).tolist() for n in PROMPT_LENS]
    reqs = [Request(f"r{i}", p, n, GREEDY, arrival_time_s=0.01 * i)
            for i, (p, n) in enumerate(zip(prompts, MAX_NEW))]
    return model, tok, reqs, reference_outputs(model, reqs)


@pytest.fixture(scope="module", params=["tiny-random-llama", "tiny-random-gpt2"])
def tiny(request):
    return cuda_setup(request.param)


def generate(runner, reqs, policy="paged", **options):
    reqs = [r.copy() for r in reqs]
    engine = make_engine(policy, runner, SimClock(), config={"max_num_seqs": 8, "block_size": 4, **options})
    engine.generate(reqs)
    return {r.request_id: r.output_token_ids for r in reqs}, engine


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("policy", ["static", "orca", "paged", "paged_prefix", "chunked", "spec_ngram"])
def test_engine_on_cuda_matches_hf_generate(tiny, backend, policy):
    model, tok, reqs, refs = tiny
    runner = ModelRunner(model, tok, attention_backend=backend)
    assert runner.device.type == "cuda"
    outputs, _ = generate(runner, reqs, policy, n_slots=1024)
    assert outputs == refs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_swap_preemption_on_cuda(tiny, backend):
    model, tok, reqs, refs = tiny
    runner = ModelRunner(model, tok, attention_backend=backend)
    outputs, engine = generate(runner, reqs, "paged", n_slots=80, preemption_mode="swap")
    assert engine.scheduler.num_preemptions > 0 and any(s.preempted for s in engine.trace)
    assert outputs == refs


def test_copy_on_write_fork_on_cuda(tiny):
    model, tok, reqs, _ = tiny
    parent = Request("p", reqs[3].prompt_token_ids, 6, GREEDY)
    ref = reference_outputs(model, [parent])["p"]
    group = fork_requests(parent, 4)
    make_engine("paged", ModelRunner(model, tok, attention_backend="triton"), SimClock(), max_num_seqs=8,
                n_slots=1024, block_size=4).generate(group)
    assert all(r.output_token_ids == ref for r in group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_shaped_model_on_cuda(dtype):
    from minibatch.equivalence import TOP_K, check_outputs, rule_for

    model, tok, reqs, _ = cuda_setup("smollm2-135m-random", dtype)
    rule = rule_for(dtype)
    if rule != "exact":
        from dataclasses import replace

        reqs = [replace(r, sampling=replace(r.sampling, logprobs=TOP_K)) for r in reqs]
    refs = reference_outputs(model, reqs, logprobs=0 if rule == "exact" else TOP_K)
    for backend in ("torch", "triton"):
        done = [r.copy() for r in reqs]
        runner = ModelRunner(model, tok, attention_backend=backend)
        make_engine("chunked", runner, SimClock(), max_num_seqs=8, n_slots=2048, block_size=16,
                    max_num_batched_tokens=32).generate(done)
        report = check_outputs(done, refs, rule)
        assert report["passed"], (backend, report)
    assert runner.decode_graphs.replays > 0  # triton's decode steps ran from CUDA graphs (its head shape, 16-blocks)


def test_wall_clock_waits_for_the_gpu():
    """A step's wall time includes the kernels it queued: the clock synchronizes before reading."""
    model, tok, reqs, _ = cuda_setup("smollm2-135m-random", torch.float32)
    reqs = [r.copy() for r in reqs]
    engine = make_engine("paged", ModelRunner(model, tok), WallClock("cuda"), max_num_seqs=8, n_slots=2048)
    engine.generate(reqs)
    assert all(s.end_s > s.start_s for s in engine.trace)


@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_decode_steps_replay_cuda_graphs(tiny, policy):
    """With the triton backend, all-decode steps replay CUDA graphs (``runner.cuda_graphs``), padded to the captured
    sizes, token for token as HF generate; ``enforce_eager`` turns them off."""
    model, tok, reqs, refs = tiny
    runner = ModelRunner(model, tok, attention_backend="triton")
    assert runner.decode_graphs is not None, runner.graphs_unsupported
    outputs, _ = generate(runner, reqs, policy, n_slots=1024)
    graphs = runner.decode_graphs
    assert outputs == refs
    assert graphs.disabled is None and graphs.replays > 0
    assert graphs.graphs and all(graph is not None for graph, _ in graphs.graphs.values())
    assert set(graphs.graphs) <= {1, 2, 4, 8}  # 8 requests at most: padded to 1, 2, 4 or 8
    eager = ModelRunner(model, tok, attention_backend="triton", enforce_eager=True)
    assert eager.decode_graphs is None and eager.graphs_unsupported == "enforce_eager=True"


def test_cuda_graphs_follow_a_reallocated_kv_cache(tiny):
    """A new KV cache (another engine's geometry) drops the graphs that read the old one; swap preemption moves
    blocks between replays."""
    model, tok, reqs, refs = tiny
    runner = ModelRunner(model, tok, attention_backend="triton")
    first, _ = generate(runner, reqs, "paged", n_slots=1024)
    graphs = runner.decode_graphs
    replayed = graphs.replays
    second, engine = generate(runner, reqs, "paged", n_slots=80, preemption_mode="swap")
    assert first == second == refs
    assert engine.scheduler.num_preemptions > 0
    assert graphs.replays > replayed and graphs.graphs and graphs.disabled is None  # recorded again, on the new cache
