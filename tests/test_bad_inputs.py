"""Bad input, class by class: every boundary (Request/SamplingParams, the engine, the run
configuration, the CLI) refuses it with one error naming the field and its allowed range; a bad
request never takes the other requests of its engine down; the CLI prints one line, never a
traceback, and exits 2 (130 on Ctrl-C). Files (second half): writes are atomic and strict JSON
(a failed write keeps the earlier file, no temp file is left), bad trace files, bad profile
files, the converted-model cache (stale temp dirs, damaged entries).
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from minibatch import ModelRunner, Request, SamplingParams, SimClock, SimExecutor, files, gguf, make_engine, models
from minibatch.__main__ import main
from minibatch.cluster.simulate import ClusterConfig, simulate
from minibatch.compare import CompareConfig, build_trace
from minibatch.reference import reference_outputs
from minibatch.report import write_json as compare_write_json
from minibatch.kv import BlockManager
from minibatch.models import load_model
from minibatch.sim.cost_model import LayoutModel, Profile
from minibatch.viz.chrome_trace import write_chrome_trace
from minibatch.trace_io import TRACE_FORMAT, load_trace, save_trace

GREEDY = SamplingParams(ignore_eos=True)


def request(**overrides) -> Request:
    fields = dict(request_id="a", prompt_token_ids=[5, 6, 7], max_new_tokens=4)
    fields.update(overrides)
    return Request(**fields)


# ----------------------------------------------------------------------------- Request fields
@pytest.mark.parametrize("overrides, field, exc", [
    (dict(request_id=3), "request_id", TypeError),
    (dict(request_id=""), "request_id", ValueError),
    (dict(request_id=None), "request_id", TypeError),
    (dict(prompt_token_ids=[]), "prompt_token_ids", ValueError),
    (dict(prompt_token_ids=[1.5, 2]), "prompt_token_ids[0]", TypeError),
    (dict(prompt_token_ids=[1, 2.0]), "prompt_token_ids[1]", TypeError),
    (dict(prompt_token_ids=[True, 2]), "prompt_token_ids[0]", TypeError),
    (dict(prompt_token_ids=[[1, 2], [3]]), "prompt_token_ids[0]", TypeError),
    (dict(prompt_token_ids=["5"]), "prompt_token_ids[0]", TypeError),
    (dict(prompt_token_ids="hello"), "prompt_token_ids", TypeError),
    (dict(prompt_token_ids=7), "prompt_token_ids", TypeError),
    (dict(prompt_token_ids={1: 2}), "prompt_token_ids", TypeError),
    (dict(prompt_token_ids=[3, -1]), "prompt_token_ids[1]", ValueError),
    (dict(prompt_token_ids=[None]), "prompt_token_ids[0]", TypeError),
    (dict(max_new_tokens=0), "max_new_tokens", ValueError),
    (dict(max_new_tokens=-5), "max_new_tokens", ValueError),
    (dict(max_new_tokens=2.5), "max_new_tokens", TypeError),
    (dict(max_new_tokens=3.0), "max_new_tokens", TypeError),
    (dict(max_new_tokens=True), "max_new_tokens", TypeError),
    (dict(max_new_tokens="4"), "max_new_tokens", TypeError),
    (dict(max_new_tokens=10**9), "max_new_tokens", ValueError),
    (dict(arrival_time_s=-1.0), "arrival_time_s", ValueError),
    (dict(arrival_time_s=math.nan), "arrival_time_s", ValueError),
    (dict(arrival_time_s=math.inf), "arrival_time_s", ValueError),
    (dict(arrival_time_s="0"), "arrival_time_s", TypeError),
    (dict(priority=1.5), "priority", TypeError),
    (dict(priority=True), "priority", TypeError),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens", ValueError),
    (dict(num_speculative_tokens=1000), "num_speculative_tokens", ValueError),
    (dict(sampling={"temperature": 0}), "sampling", TypeError),
    (dict(prompt_text=5), "prompt_text", TypeError),
    (dict(parent_request_id=5), "parent_request_id", TypeError),
])
def test_request_fields(overrides, field, exc):
    with pytest.raises(exc, match=field.replace("[", r"\[").replace("]", r"\]")):
        request(**overrides)


def test_request_accepts_integer_types_of_any_kind():
    import numpy as np

    r = request(prompt_token_ids=(np.int64(5), torch.tensor(6), 7), max_new_tokens=np.int32(4))
    assert r.prompt_token_ids == [5, 6, 7] and type(r.prompt_token_ids[0]) is int and r.max_new_tokens == 4


def test_type_errors_are_value_errors_too():
    """Callers catching ValueError for any bad input (the CLI, the trace reader) catch wrong types."""
    with pytest.raises(ValueError):
        request(max_new_tokens=2.5)


# ----------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize("kwargs, field, exc", [
    (dict(temperature=-0.1), "temperature", ValueError),
    (dict(temperature=math.nan), "temperature", ValueError),
    (dict(temperature=math.inf), "temperature", ValueError),
    (dict(temperature=1e-40), "temperature", ValueError),
    (dict(temperature=1e6), "temperature", ValueError),
    (dict(temperature="hot"), "temperature", TypeError),
    (dict(temperature=True), "temperature", TypeError),
    (dict(top_k=-1), "top_k", ValueError),
    (dict(top_k=2.5), "top_k", TypeError),
    (dict(top_p=0.0), "top_p", ValueError),
    (dict(top_p=1.5), "top_p", ValueError),
    (dict(top_p=math.nan), "top_p", ValueError),
    (dict(seed=-1), "seed", ValueError),
    (dict(seed=2**64), "seed", ValueError),
    (dict(seed=1.5), "seed", TypeError),
    (dict(ignore_eos="yes"), "ignore_eos", TypeError),
])
def test_sampling_params_fields(kwargs, field, exc):
    with pytest.raises(exc, match=field):
        SamplingParams(**kwargs)


def test_stop_token_ids_are_kept_once_each_in_order():
    assert SamplingParams(stop_token_ids=[7, 3, 7, 3, 9] * 1000).stop_token_ids == (7, 3, 9)


def test_smallest_allowed_temperature_samples_without_overflow():
    from minibatch.runner.sampler import Sampler

    logits = torch.tensor([0.0, 30.0, 29.0, -5.0])
    params = SamplingParams(temperature=1e-5, seed=0)
    assert Sampler().sample("r", logits, params) == 1  # the argmax: no NaN from the overflow


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def tiny(one_thread):
    """(model, runner, prompts, HF greedy references r0..r2)."""
    model, tok = load_model("tiny-random-llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (6, 11, 4)]
    reqs = [Request(f"r{i}", p, 6, GREEDY) for i, p in enumerate(prompts)]
    return model, ModelRunner(model, tok), prompts, reference_outputs(model, reqs)


@pytest.mark.parametrize("policy", ["static", "orca", "paged", "chunked", "spec_ngram"])
@pytest.mark.parametrize("bad_ids", [[600], [511, 512], [-1 + 513 * 1000]])
def test_out_of_vocab_request_is_refused_and_the_others_finish(tiny, policy, bad_ids):
    model, runner, prompts, refs = tiny
    engine = make_engine(policy, runner, SimClock(), config=dict(n_slots=512, max_num_seqs=4, batch_size=4))
    good = [Request(f"r{i}", p, 6, GREEDY) for i, p in enumerate(prompts)]
    engine.add_request(good[0])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[\d\] must be in \[0, 512\) \(the model's vocab_size\)"):
        engine.add_request(Request("bad", prompts[1][:3] + bad_ids, 6, GREEDY))
    for r in good[1:]:
        engine.add_request(r)
    engine.generate([])
    assert {r.request_id: r.output_token_ids for r in good} == refs
    assert "bad" not in engine.requests


@pytest.mark.parametrize("policy", ["orca", "paged"])
def test_too_long_request_is_refused_and_the_others_finish(tiny, policy):
    model, runner, prompts, refs = tiny
    engine = make_engine(policy, runner, SimClock(), n_slots=512)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(Request("long", prompts[0], runner.max_model_len, GREEDY))
    good = engine.generate([Request(f"r{i}", p, 6, GREEDY) for i, p in enumerate(prompts)])
    assert {r.request_id: r.output_token_ids for r in good} == refs


@pytest.mark.parametrize("bad", [None, "r0", {"request_id": "x"}, 5])
def test_add_request_takes_only_requests(bad):
    engine = make_engine("paged", SimExecutor(), SimClock())
    with pytest.raises(TypeError, match="Request"):
        engine.add_request(bad)


def test_add_request_refuses_a_duplicate_id_and_a_used_request():
    engine = make_engine("paged", SimExecutor(), SimClock())
    r = request(sampling=GREEDY)
    engine.add_request(r)
    with pytest.raises(ValueError, match="already added"):
        engine.add_request(request(sampling=GREEDY))
    engine.generate([])
    with pytest.raises(ValueError, match="already ran"):
        make_engine("paged", SimExecutor(), SimClock()).add_request(r)


@pytest.mark.parametrize("policy", ["static", "orca", "paged", "chunked"])
def test_step_with_nothing_queued_is_a_no_op(policy):
    engine = make_engine(policy, SimExecutor(), SimClock())
    assert engine.step() is None and engine.clock.now_s == 0.0 and engine.trace == []
    engine.generate([request(sampling=GREEDY)])
    now = engine.clock.now_s
    assert engine.step() is None and engine.clock.now_s == now  # all finished: still nothing to do


# ----------------------------------------------------------------------------- make_engine / SimExecutor
@pytest.mark.parametrize("policy, kwargs, field", [
    ("paged", dict(block_size=0), "block_size"),
    ("orca", dict(block_size=0), "block_size"),
    ("chunked", dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    ("paged", dict(max_num_batched_tokens=-3), "max_num_batched_tokens"),
    ("paged", dict(n_slots=0), "n_slots"),
    ("paged", dict(n_slots=8, block_size=16), "--n-slots .* must be >= --block-size 16"),  # the config names options
    ("orca", dict(max_num_seqs=0), "max_num_seqs"),
    ("static", dict(batch_size=0), "batch_size"),
    ("static", dict(max_wait_s=math.inf), "max_wait_s"),
    ("static", dict(max_wait_s=-1), "max_wait_s"),
    ("paged", dict(max_num_seqs=2.5), "max_num_seqs"),
    ("paged", dict(watermark=1.0), "watermark"),
    ("paged", dict(preemption_mode="drop"), "preemption_mode"),
    ("chunked", dict(target_itl_s=math.nan), "target_itl_s"),
    ("paged", dict(target_itl_s=0.05), "target_itl_s"),
    ("orca", dict(max_num_prefills=2), "max_num_prefills"),
    ("paged", dict(queue_policy="lifo"), "queue_policy"),
    ("paged", dict(aging_s=0, queue_policy="priority"), "aging_s"),
    ("spec_ngram", dict(num_speculative_tokens=0), "num_speculative_tokens"),
    ("fancy", {}, "policy"),
])
def test_make_engine_refuses_bad_arguments_never_replaces_them(policy, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_engine(policy, SimExecutor(acceptance_rate=0.5), SimClock(), **kwargs)


@pytest.mark.parametrize("rate", [1.5, -0.1, math.nan, [], [0.3, 0.6], [0.9, 0.5, 0.7]])
def test_sim_executor_acceptance_rate(rate):
    with pytest.raises(ValueError, match="acceptance_rate"):
        SimExecutor(acceptance_rate=rate)


# ----------------------------------------------------------------------------- two engines, one runner
def test_two_engines_sharing_a_runner_cannot_interleave(tiny):
    model, runner, prompts, refs = tiny
    a = make_engine("paged", runner, SimClock(), n_slots=256)
    b = make_engine("orca", runner, SimClock(), n_slots=512)
    for i, p in enumerate(prompts):
        a.add_request(Request(f"r{i}", p, 6, GREEDY))
        b.add_request(Request(f"r{i}", p, 6, GREEDY))
    a.step()  # a now holds KV in the runner's cache
    with pytest.raises(RuntimeError, match="another engine"):
        b.step()
    a.generate([])  # a finishes undisturbed ...
    b.generate([])  # ... then b may take the runner
    assert {r: q.output_token_ids for r, q in a.requests.items()} == refs
    assert {r: q.output_token_ids for r, q in b.requests.items()} == refs


def test_prefix_cache_is_forgotten_when_another_engine_used_the_runner(tiny):
    """A freed, cached block may be overwritten by the other engine: a cache hit on it later would
    serve another request's KV. Taking the runner back empties the prefix cache."""
    model, runner, prompts, refs = tiny
    a = make_engine("paged_prefix", runner, SimClock(), n_slots=256, block_size=4)
    a.generate([Request("r1", prompts[1], 6, GREEDY)])
    assert a.scheduler.block_manager.cached_blocks
    b = make_engine("paged", runner, SimClock(), n_slots=256, block_size=4)
    b.generate([Request(f"x{i}", list(reversed(p)), 6, GREEDY) for i, p in enumerate(prompts)])  # overwrites blocks
    again = a.generate([Request("r1-again", prompts[1], 6, GREEDY)])[0]
    assert again.output_token_ids == refs["r1"]
    assert a.scheduler.block_manager.num_prefix_hit_tokens == 0  # no hit on overwritten KV


def test_a_preempted_seeded_request_keeps_its_generator_when_another_engine_used_the_runner(tiny):
    """An engine whose only unfinished request waits after a recompute preemption holds no KV, so another engine may
    step on the runner meanwhile; the waiting request's seeded generator goes on where it was (the runner's sampler
    used to be replaced on every change of engine, restarting it from its seed)."""
    model, runner, _, _ = tiny
    tok = runner.tokenizer
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (8,), generator=g).tolist() for _ in range(2)]

    def requests():
        return [Request(f"r{i}", p, 20, SamplingParams(temperature=1.0, seed=i + 1, ignore_eos=True),
                        arrival_time_s=0.001 * i) for i, p in enumerate(prompts)]

    alone = {}
    for r in requests():
        make_engine("paged", ModelRunner(model, tok), SimClock(), n_slots=1024, block_size=4).generate([r])
        alone[r.request_id] = r.output_token_ids
    a = make_engine("paged", runner, SimClock(), n_slots=36, block_size=4, max_num_seqs=2, watermark=0.0)
    reqs = requests()
    for r in reqs:
        a.add_request(r)
    interleaved = False
    while a.has_unfinished():
        a.step()
        s = a.scheduler
        if not interleaved and not s.running and not s.swapped and any(r.output_token_ids for r in s.waiting):
            other = Request("r0", prompts[0], 5, SamplingParams(temperature=1.0, seed=9, ignore_eos=True))
            make_engine("paged", runner, SimClock(), n_slots=36, block_size=4).generate([other])  # the same id
            interleaved = True
    assert interleaved and a.scheduler.num_preemptions >= 1
    assert {r.request_id: r.output_token_ids for r in reqs} == alone


# ----------------------------------------------------------------------------- memory grows with use
def test_block_manager_bookkeeping_grows_with_use_not_size():
    import tracemalloc

    tracemalloc.start()
    bm = BlockManager(10**12, block_size=1, num_cpu_blocks=10**12)
    r = request()
    assert bm.allocate_slots(r, 3) == [] and bm.num_free_blocks == 10**12 - 3
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert size < 1_000_000
    bm.check_invariants()


def test_huge_simulated_kv_cache_runs():
    engine = make_engine("orca", SimExecutor(), SimClock(), n_slots=2**26, max_num_seqs=4)
    out = engine.generate([Request(f"r{i}", [1, 2, 3], 5, GREEDY) for i in range(3)])
    assert all(r.num_output_tokens == 5 for r in out)


def test_kv_cache_larger_than_memory_is_a_clear_error(tiny):
    model, runner, *_ = tiny
    with pytest.raises(ValueError, match="--n-slots.*GiB"):
        runner.allocate_kv_cache(10**9, 16)
    runner.allocate_kv_cache(16, 16)  # still usable


# ----------------------------------------------------------------------------- the run configuration
@pytest.mark.parametrize("field, value, option", [
    ("num_requests", 0, "--num-requests"), ("num_requests", 10**9, "--num-requests"),
    ("num_requests", 2.5, "--num-requests"), ("rate", 0, "--rate"), ("rate", math.inf, "--rate"),
    ("rate", math.nan, "--rate"), ("rate", "fast", "--rate"), ("seed", -1, "--seed"), ("seed", 2**40, "--seed"),
    ("batch_size", 0, "--batch-size"), ("max_num_seqs", 10**9, "--max-num-seqs"),
    ("max_wait_s", math.inf, "--max-wait-s"),
    ("max_wait_s", -0.5, "--max-wait-s"), ("max_prompt_len", 0, "--max-prompt-len"),
    ("max_output_len", 10**9, "--max-output-len"), ("output_scale", 0, "--output-scale"),
    ("n_slots", 0, "--n-slots"), ("n_slots", 10**9, "--n-slots"), ("n_slots", 1.5, "--n-slots"),
    ("block_size", 0, "--block-size"), ("block_size", 10**6, "--block-size"),
    ("max_num_batched_tokens", 0, "--max-num-batched-tokens"), ("target_itl_s", 0, "--target-itl-s"),
    ("target_itl_s", math.inf, "--target-itl-s"), ("aging_s", -1, "--aging-s"),
    ("long_prompts", -1, "--long-prompts"), ("long_prompt_len", 0, "--long-prompt-len"),
    ("num_speculative_tokens", 0, "--num-speculative-tokens"),
    ("num_speculative_tokens", 10**6, "--num-speculative-tokens"),
    ("slo_ttft_s", 0, "--slo-ttft-s"), ("slo_tpot_s", math.nan, "--slo-tpot-s"),
    ("slo_ttft_s", math.inf, "--slo-ttft-s"),
    ("arrival", "uniform", "--arrival"), ("clock", "sundial", "--clock"), ("device", "tpu", "--device"),
    ("device", "cuda:7", "--device"), ("preemption_mode", "drop", "--preemption-mode"),
    ("attention_backend", "cuda", "--attention-backend"), ("queue_policy", "lifo", "--queue-policy"),
    ("reserve_new_tokens", 0, "--reserve-new-tokens"), ("batch_size", 0, "--batch-size"),
    ("policies", (), "--policies"), ("policies", "orca", "--policies"), ("model", "no-such-model", "--model"),
    ("model", "./no/such/dir", "--model"),
    ("model", "/", "--model"), ("model", 5, "--model"), ("draft_model", "nope", "--draft-model"),
    ("trace", "/no/such/trace.json", "--trace"), ("profile", "/no/such/profile.json", "--profile"),
    ("adaptive_k", "yes", "--adaptive-k"),
])
def test_run_config_field(field, value, option):
    """A run option, or a policy setting (checked by the config of every selected policy that has it)."""
    from minibatch.policies import setting_names

    fields = {"settings": {field: value}, "policies": ("all",)} if field in setting_names() else {field: value}
    with pytest.raises(ValueError, match=option):
        CompareConfig(**{"model": "tiny-random-llama"} | fields)


def test_run_config_is_the_clis_config():
    """One dataclass validates for both: the CLI builds it, so a later CLI keeps the checks. A setting
    left None is not set."""
    cfg = CompareConfig(model="tiny-random-llama", settings={"n_slots": None, "max_num_batched_tokens": None})
    assert cfg.settings == {}


def test_a_setting_no_selected_policy_has_is_refused():
    with pytest.raises(ValueError, match=r"--target-itl-s does not apply to the selected policies \(static,paged\); "
                                         "it applies to chunked, chunked_prefix"):
        CompareConfig(model="tiny-random-llama", policies=("static", "paged"), settings={"target_itl_s": 0.1})
    with pytest.raises(ValueError, match="--max-num-seqs does not apply to the selected policies"):
        CompareConfig(model="tiny-random-llama", policies=("static",), settings={"max_num_seqs": 4})
    with pytest.raises(ValueError, match="no-such-setting"):
        CompareConfig(model="tiny-random-llama", settings={"no_such_setting": 1})


# ----------------------------------------------------------------------------- the CLI, in process
def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    return e.value.code, err


@pytest.mark.parametrize("argv, message", [
    (["compare", "--n-slots", "0"], "--n-slots must be"),
    (["compare", "--n-slots", "-5"], "--n-slots must be"),
    (["compare", "--n-slots", "1000000000"], "--n-slots must be"),
    (["compare", "--n-slots", "1e9"], "--n-slots"),
    (["compare", "--rate", "inf"], "--rate must be"),
    (["compare", "--rate", "nan"], "--rate must be"),
    (["compare", "--rate", "-2"], "--rate must be"),
    (["compare", "--rate", "fast"], "--rate"),
    (["compare", "--seed", "-1"], "--seed must be"),
    (["compare", "--seed", "1.5"], "--seed"),
    (["compare", "--block-size", "0"], "--block-size must be"),
    (["compare", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be"),
    (["compare", "--target-itl-s", "nan"], "--target-itl-s must be"),
    (["compare", "--max-wait-s", "inf"], "--max-wait-s must be"),
    (["compare", "--max-wait-s", "-1"], "--max-wait-s must be"),
    (["compare", "--slo-ttft-s", "0"], "--slo-ttft-s must be"),
    (["compare", "--slo-tpot-s", "inf"], "--slo-tpot-s must be"),
    (["compare", "--max-output-len", "1000000000"], "--max-output-len must be"),
    (["compare", "--num-requests", "0"], "--num-requests must be"),
    (["compare", "--batch-size", "0"], "--batch-size must be"),
    (["compare", "--model", "no-such-model"], "--model"),
    (["compare", "--model", "/no/such/dir"], "--model"),
    (["compare", "--model", "README.md"], "--model"),
    (["compare", "--device", "tpu"], "--device"),
    (["compare", "--device", "cuda:3"], "--device"),
    (["compare", "--policies", ","], "--policies"),
    (["compare", "--draft-model", "nope"], "--draft-model"),
    (["simulate", "--profile", "/no/such.json"], "--profile"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--acceptance-rate", "1.5"], "--acceptance-rate"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--acceptance-rate", "0.3,0.6"],
     "non-increasing"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--acceptance-rate", "x"], "--acceptance-rate"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--policies", "hf_generate"], "--policies"),
    (["calibrate", "--scale", "0"], "--scale"),
    (["calibrate", "--scale", "nan"], "--scale"),
    (["calibrate", "--threads", "0"], "--threads"),
    (["calibrate", "--device", "gpu"], "--device"),
    (["calibrate", "--model", "no-such-model"], "--model"),
    (["calibrate", "--draft-only", "/no/such.json", "--draft-model", "tiny-random-llama"], "/no/such.json"),
    (["calibrate", "--refit", "README.md"], "README.md"),
    (["calibrate", "--draft-only", "data/profiles/smollm2-135m-cpu.json"], "--draft-model"),
    # an option of a simulate mode given without the mode (it used to be silently ignored)
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--conversations", "5"], "--workload multiturn"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--kv-link-gbps", "5"], "--disaggregate"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--policies", "paged", "--disaggregate", "1:1",
      "--replicas", "2"], "--replicas"),
    (["sweep", "--grid", "benchmarks/grids/disaggregation.yaml", "--ray-address", "127.0.0.1:1"], "--ray-address"),
    (["sweep", "--grid", "benchmarks/grids/disaggregation.yaml", "--ray-address", "garbage"], "--ray-address"),
    (["sweep", "--grid", "benchmarks/grids/disaggregation.yaml", "--cache", "README.md"], "--cache"),
    (["sweep", "--grid", ""], "--grid"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--policies", "paged", "--acceptance-rate",
      "0.5"], "--acceptance-rate"),
    (["compare", "--model", "tiny-random-llama", "--reference-cache", "README.md"], "--reference-cache"),
    (["compare", "--model", "tiny-random-llama", "--clock", "wall", "--profile",
      "data/profiles/smollm2-135m-cpu.json"], "--profile applies only with --clock sim"),
    (["gpu-check", "--device", "cpu", "--steps", "environment", "--bench-requests", "4"], "--bench-requests"),
    (["serve", "--model", "tiny-random-llama", "--port", "1", "--served-model-name", ""], "--served-model-name"),
    # calibrate's measuring options were silently ignored by --refit (and some by --draft-only)
    (["calibrate", "--refit", "data/profiles/smollm2-135m-cpu.json", "--threads", "2"], "--threads does not apply"),
    (["calibrate", "--refit", "data/profiles/smollm2-135m-cpu.json", "--draft-only",
      "data/profiles/smollm2-135m-cpu.json"], "--draft-only does not apply with --refit"),
    (["calibrate", "--draft-only", "data/profiles/smollm2-135m-cpu.json", "--draft-model", "tiny-random-llama",
      "--dtype", "bfloat16"], "--dtype does not apply with --draft-only"),
    # options a mode ignores: the multiturn workload's own shape, per-position acceptance rates past k
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--workload", "multiturn", "--num-requests",
      "5"], "--num-requests does not apply with --workload multiturn"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--policies", "spec", "--acceptance-rate",
      "0.9,0.8,0.7", "--num-speculative-tokens", "2"], "3 per-position rates, more than the 2 draft positions"),
    # accepted and ignored, or failing late or unnamed (a probe's finds)
    (["compare", "--model", "tiny-random-llama", "--policies", "hf_generate", "--kv-cache-memory-bytes", "100000"],
     "--kv-cache-memory-bytes sizes a KV cache that none of hf_generate has"),
    (["compare", "--model", "tiny-random-llama", "--policies", "hf_generate", "--clock", "sim"],
     "--clock applies only to our engine's policies"),
    (["compare", "--model", "tiny-random-llama", "--policies", "hf_generate", "--trace-out", "traces"],
     "--trace-out applies only to our engine's policies"),
    (["compare", "--model", "tiny-random-llama", "--trace-out", ""], "--trace-out must be a folder path"),
    (["compare", "--model", "tiny-random-llama", "--policies", "hf_generate", "--enforce-eager"],
     "--enforce-eager applies only to our engine's policies"),  # (and to vllm's)
    (["compare", "--model", "tiny-random-llama", "--arrival-cv", "3"], "--arrival-cv applies only with"),
    (["compare", "--model", "tiny-random-llama", "--arrival", "zero", "--rate", "7"], "--rate does not apply"),
    (["compare", "--model", "tiny-random-llama", "--no-reference", "--reference-cache", "refs"],
     "--reference-cache applies only with the reference check"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--disaggregate", "\u00b2:1"], "--disaggregate"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--replicas", "2", "--trace-out", "traces"],
     "--trace-out applies to a single engine"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--workload", "multiturn", "--conversations",
      "2", "--system-prompt-len", "100", "--max-model-len", "50"], "every conversation ends before its first turn"),
    (["compare", "--model", "a" * 5000], "--model: unknown model"),  # was OSError "File name too long", rc 1
    # the profile's model has a context limit: simulate priced a 100000-token prompt on SmolLM2 (8192)
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--num-requests", "4", "--long-prompts", "1",
      "--long-prompt-len", "100000"], "requests ['req-002'] need more than smollm2-135m's max_model_len = 8192"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--num-requests", "4", "--long-prompts", "1",
      "--long-prompt-len", "100000", "--replicas", "2"], "need more than smollm2-135m's max_model_len = 8192"),
    (["compare", "--model", "tiny-random-llama", "--clock", "sim", "--num-requests", "4", "--long-prompts", "1",
      "--long-prompt-len", "5000", "--policies", "paged"], "max_model_len = 512 tokens (--max-prompt-len, "
     "--max-output-len, --long-prompt-len, --trace)"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--workload", "multiturn", "--max-model-len",
      "9000"], "--max-model-len 9000 exceeds smollm2-135m's max_model_len 8192"),
    # n_slots below one block: named as options, or as --kv-cache-memory-bytes when that sized the cache
    (["compare", "--model", "tiny-random-llama", "--policies", "paged", "--n-slots", "8", "--no-reference"],
     "--n-slots (KV cache token slots) must be >= --block-size 16 (one KV block at least), got 8"),
    (["compare", "--model", "tiny-random-llama", "--policies", "paged", "--kv-cache-memory-bytes", "3000",
      "--no-reference"], "--kv-cache-memory-bytes // 256 KV bytes per token (n_slots: one KV block of 16 tokens"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--aging-s", "0.5"],
     "--aging-s applies only with --queue-policy priority"),
    (["compare", "--model", "tiny-random-llama", "--policies", "chunked", "--target-itl-s", "0.2",
      "--max-num-batched-tokens", "16"], "--max-num-batched-tokens does not apply with --target-itl-s"),
    # --draft-model without a policy that drafts with a model was silently ignored
    (["compare", "--model", "tiny-random-llama", "--policies", "paged,spec_ngram", "--draft-model",
      "tiny-random-llama"], "--draft-model applies only"),
    (["serve", "--model", "tiny-random-llama", "--port", "1", "--policy", "paged", "--draft-model",
      "tiny-random-llama"], "--draft-model applies only"),
    # the calibration's longest request (1026 tokens at --scale 1) must fit the model's max_model_len (512)
    (["calibrate", "--model", "tiny-random-llama", "--quick", "--threads", "1"], "use --scale <= 0.49"),
    # comma lists: no empty items, no item twice
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--policies", "orca,,paged"], "--policies"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--policies", ","], "--policies"),
    (["profile", "--model", "tiny-random-llama", "--decode-batches", "1,,2"], "--decode-batches"),
    (["profile", "--model", "tiny-random-llama", "--prefill-lens", "8,8"], "--prefill-lens"),
    (["profile", "--model", "tiny-random-llama", "--decode-batches", "", "--prefill-lens", ""], "nothing to profile"),
    (["profile", "--model", "tiny-random-llama", "--json", ""], "--json"),
    (["gpu-check", "--device", "cpu", "--steps", ""], "--steps"),
    (["gpu-check", "--device", "cpu", "--steps", "environment,environment"], "--steps"),
    (["gpu-check", "--device", "", "--steps", "environment"], "--device"),
    (["gpu-check", "--device", "cpu", "--out", ""], "--out"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--policies", "paged", "--disaggregate",
      "1000000:1"], "--disaggregate"),
    # a run where every selected policy is skipped (vLLM not here) failed; a KV budget too small or too large
    (["compare", "--model", "tiny-random-llama", "--no-reference", "--policies", "vllm", "--num-requests", "2",
      "--figures-dir", "", "--no-progress"], "none of the selected policies could run"),
    (["compare", "--model", "tiny-random-llama", "--clock", "sim", "--policies", "paged", "--num-requests", "2",
      "--kv-cache-memory-bytes", "1", "--figures-dir", "", "--no-progress"], "--kv-cache-memory-bytes"),
    (["compare", "--model", "tiny-random-llama", "--clock", "sim", "--policies", "paged", "--num-requests", "2",
      "--kv-cache-memory-bytes", "1000000000000", "--figures-dir", "", "--no-progress"], "--kv-cache-memory-bytes"),
    # given for nothing: a router with one replica to pick, a think time with no next turn, an empty server URL
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--router", "least_kv"], "--router"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--policies", "paged", "--disaggregate", "1:1",
      "--router", "least_outstanding"], "--router"),
    (["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--workload", "multiturn", "--think-time-s",
      "3", "--max-turns", "1"], "--think-time-s"),
    (["bench-serve", "--base-url", ""], "--base-url"),
    (["bench-serve", "--base-url", "localhost:8000"], "--base-url"),
    (["serve", "--model", "tiny-random-llama", "--policy", "paged", "--batch-size", "4"], "applies to static\n"),
])
def test_cli_bad_option_is_one_line_exit_2(argv, message, capsys, monkeypatch):
    from minibatch.baselines import vllm_peer

    find_spec = vllm_peer.importlib.util.find_spec
    monkeypatch.setattr(vllm_peer.importlib.util, "find_spec",  # vLLM is never here
                        lambda name, *a: None if name == "vllm" else find_spec(name, *a))

    code, err = run_cli(argv, capsys)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("minibatch ") and "Traceback" not in err


def test_calibrate_refit_with_only_its_own_options_still_refits(tmp_path, capsys):
    """--refit with --out and --no-progress (and a measuring option at its default value) still runs."""
    out, profile = tmp_path / "refit.json", "data/profiles/smollm2-135m-cpu.json"
    assert main(["calibrate", "--refit", profile, "--out", str(out), "--no-progress", "--scale", "1.0"]) == 0
    before, after = (json.loads(Path(p).read_text()) for p in (profile, out))
    assert after["samples"] == before["samples"] and after["layouts"].keys() == before["layouts"].keys()


def test_cli_checks_output_paths_before_loading_a_model(tmp_path, capsys, monkeypatch):
    import minibatch.models

    monkeypatch.setattr(minibatch.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    (tmp_path / "file").write_text("keep me")
    for argv, option in ((["--json", str(tmp_path)], "--json"),
                         (["--figures-dir", str(tmp_path / "file")], "--figures-dir"),
                         (["--trace-out", str(tmp_path / "file" / "sub")], "--trace-out")):
        code, err = run_cli(["compare", "--dtype", "float32", "--model", "tiny-random-llama"] + argv, capsys)
        assert code == 2 and option in err
    assert (tmp_path / "file").read_text() == "keep me"


def test_cli_run_time_input_error_is_one_line(tmp_path, capsys):
    """A trace whose ids the model cannot embed is found after the model loads, before any run."""
    from minibatch.trace_io import save_trace

    path = tmp_path / "t.json"
    save_trace([Request("a", [1, 2, 9999], 3, GREEDY)], path)
    code, err = run_cli(["compare", "--dtype", "float32", "--model", "tiny-random-llama", "--trace", str(path),
                         "--clock", "sim",
                         "--figures-dir", "", "--no-progress", "--no-reference", "--policies", "orca"], capsys)
    assert code == 2 and "vocab" in err and len(err.strip().splitlines()) == 1


def test_options_that_do_nothing_where_given_are_refused(tmp_path, capsys):
    """simulate --seed with --trace seeds only the speculative policies' draws; profile times the model's own steps
    (no --draft-model); a router among 2+ replicas, or a think time before a second turn, still runs."""
    from minibatch.trace_io import save_trace

    path = tmp_path / "t.json"
    save_trace([Request("a", [1, 2, 3], 3, GREEDY)], path)
    sim = ["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--trace", str(path), "--seed", "3"]
    code, err = run_cli(sim + ["--policies", "orca"], capsys)
    assert code == 2 and "--seed" in err and len(err.strip().splitlines()) == 1
    assert main(sim + ["--policies", "orca,spec_ngram", "--acceptance-rate", "0.7", "--no-progress"]) == 0
    code, err = run_cli(["profile", "--model", "tiny-random-llama", "--draft-model", "tiny-random-llama"], capsys)
    assert code == 2 and "--draft-model" in err and len(err.strip().splitlines()) == 1
    for extra in (["--replicas", "2", "--router", "least_kv", "--num-requests", "4"],
                  ["--workload", "multiturn", "--conversations", "2", "--think-time-s", "3", "--max-turns", "2"]):
        assert main(["simulate", "--profile", "data/profiles/smollm2-135m-cpu.json", "--policies", "orca",
                     "--no-progress", *extra]) == 0


def test_cli_ctrl_c_is_one_line_exit_130_and_keeps_the_old_file(tmp_path, capsys, monkeypatch):
    import minibatch.compare

    out = tmp_path / "r.json"
    out.write_text('{"old": true}\n')

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(minibatch.__main__, "run_compare", interrupted)
    code, err = run_cli(["compare", "--dtype", "float32", "--model", "tiny-random-llama", "--json", str(out)], capsys)
    assert code == 130 and err.strip() == "minibatch compare: interrupted"
    assert json.loads(out.read_text()) == {"old": True}


# ----------------------------------------------------------------------------- the CLI, end to end
@pytest.mark.parametrize("argv", [
    ["compare", "--n-slots", "0"],
    ["compare", "--rate", "nan"],
    ["simulate", "--profile", "/no/such.json"],
    ["calibrate", "--device", "tpu"],
])
def test_cli_subprocess_exit_code_and_no_traceback(argv):
    proc = subprocess.run([sys.executable, "-m", "minibatch", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == ""


def test_cli_subprocess_sigint_exits_130_without_traceback(tmp_path):
    """A real Ctrl-C (SIGINT) in the middle of a simulated run."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "minibatch", "simulate", "--profile",
                             "data/profiles/smollm2-135m-cpu.json", "--num-requests", "200000", "--rate", "1000",
                             "--no-progress", "--json", str(tmp_path / "s.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
                            # a test run started in the background (`cmd &` in a script) has SIGINT ignored, and an
                            # ignored signal stays ignored across exec: Python then installs no Ctrl-C handler
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:  # the run has started once the trace is built
            if line.startswith("trace:"):
                break
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # show where it is stuck (faulthandler dumps every thread on SIGABRT)
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=60)
            raise AssertionError(f"still running 120 s after SIGINT; its stacks:\n{err[-4000:]}") from None
    finally:  # never leave a runaway simulation behind (it would hold a core and memory for the rest of the run)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].endswith("interrupted")
    assert not list(tmp_path.iterdir())  # no partial file


# ============================================================================= files
COMMITTED_PROFILE = Path(__file__).resolve().parent.parent / "data" / "profiles" / "smollm2-135m-cpu.json"


def strict_loads(text: str):
    """json.loads that refuses NaN / Infinity (what a strict parser does)."""
    def refuse(name):
        raise AssertionError(f"{name} in the JSON output")
    return json.loads(text, parse_constant=refuse)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


# ----------------------------------------------------------------------------- atomic writes

def _requests():
    return [Request("a", [5, 6, 7], 3, SamplingParams(ignore_eos=True)),
            Request("b", [8, 9], 2, arrival_time_s=0.5)]


def _profile():
    m = LayoutModel(knots=[1, 2], curve_s=[0.01, 0.02], coef_s=dict.fromkeys(
        ("logits", "prefill_rows", "prefill_attention", "decode_attention"), 0.0))
    return Profile("toy", {"packed": m}, meta={"vocab_size": 64})


WRITERS = {  # name -> write(path): every writer of the package goes through minibatch.files
    "files.write_json": lambda p: files.write_json(p, {"x": 1}),
    "compare.write_json": lambda p: compare_write_json({"x": 1}, p),
    "save_trace": lambda p: save_trace(_requests(), p),
    "Profile.save": lambda p: _profile().save(p),
    "write_chrome_trace": lambda p: write_chrome_trace(p, [], _requests()),
}


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


FAILURES = {  # name -> (function of os to replace, replacement, exception expected)
    "disk full in write": ("write", _enospc, OSError),
    "disk full in fsync": ("fsync", _enospc, OSError),
    "rename fails": ("replace", _enospc, OSError),
    "Ctrl-C mid-write": ("write", _interrupt, KeyboardInterrupt),
}


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("writer", WRITERS)
def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch, writer, failure):
    path = tmp_path / "out.json"
    path.write_text('{"good": "earlier result"}\n')
    name, replacement, exc = FAILURES[failure]
    monkeypatch.setattr(os, name, replacement)
    with pytest.raises(exc) as info:
        WRITERS[writer](path)
    monkeypatch.undo()
    if exc is OSError:
        assert info.value.errno == errno.ENOSPC and str(path) in str(info.value)
    assert path.read_text() == '{"good": "earlier result"}\n'
    assert leftovers(tmp_path) == []


def test_a_device_or_pipe_is_never_replaced_by_an_output_file(tmp_path, capsys):
    """An output path that is a pipe (or /dev/null, a socket) was replaced by a regular file (os.replace); now the
    option check refuses it and the atomic writer never replaces it."""
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--profile", str(COMMITTED_PROFILE), "--num-requests", "2", "--json", str(fifo)])
    assert e.value.code == 2 and "not a regular file" in capsys.readouterr().err
    with pytest.raises(OSError, match="not a regular file"):
        files.atomic_write_text(fifo, "{}")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("writer", WRITERS)
def test_writers_write_strict_json_atomically(tmp_path, writer):
    path = tmp_path / "deep" / "er" / "out.json"
    WRITERS[writer](path)
    strict_loads(path.read_text())
    assert leftovers(path.parent) == []


def test_unserialisable_result_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        files.write_json(path, {"x": {1, 2}})  # a set: json refuses it before any byte is written
    assert path.read_text() == "old" and leftovers(tmp_path) == []


def test_json_dumps_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "out.json"
    path.write_text("old")
    monkeypatch.setattr(json, "dumps", _enospc)
    with pytest.raises(OSError):
        compare_write_json({"x": 1}, path)
    monkeypatch.undo()
    assert path.read_text() == "old" and leftovers(tmp_path) == []


def test_replace_keeps_mode_and_new_file_follows_umask(tmp_path):
    old = tmp_path / "old.json"
    old.write_text("{}")
    old.chmod(0o640)
    files.write_json(old, {"a": 1})
    assert (old.stat().st_mode & 0o777) == 0o640 and json.loads(old.read_text()) == {"a": 1}
    umask = os.umask(0o022)
    os.umask(umask)
    new = files.write_json(tmp_path / "new.json", [1])
    assert (new.stat().st_mode & 0o777) == 0o666 & ~umask


def test_write_to_a_folder_or_under_a_file_fails_cleanly(tmp_path):
    (tmp_path / "adir").mkdir()
    with pytest.raises(OSError, match="adir"):
        files.write_json(tmp_path / "adir", {"x": 1})
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(OSError, match="afile"):
        files.write_json(tmp_path / "afile" / "out.json", {"x": 1})
    assert (tmp_path / "afile").read_text() == "keep" and leftovers(tmp_path) == []
    assert leftovers(tmp_path / "adir") == []


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float64("nan"), float("1e999")],
                         ids=["nan", "inf", "-inf", "np.nan", "1e999"])
def test_non_finite_floats_become_null(tmp_path, value):
    obj = {"metric": value, "nested": [1.5, {"deep": (value, 2)}], "ok": 0.25, "flag": True}
    path = files.write_json(tmp_path / "r.json", obj)
    back = strict_loads(path.read_text())
    assert back == {"metric": None, "nested": [1.5, {"deep": [None, 2]}], "ok": 0.25, "flag": True}
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


# ----------------------------------------------------------------------------- output paths checked up front

@pytest.fixture
def unwritable_dir(tmp_path):
    """A folder nobody may write in (chmod; as root, which ignores modes, a kernel folder)."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    for candidate in (d, Path("/sys")):
        try:
            with tempfile.TemporaryFile(dir=candidate):
                pass
        except OSError:
            yield candidate
            break
    else:
        pytest.skip("no unwritable folder on this machine")
    d.chmod(0o700)


def test_check_output_paths_accept_good_paths_and_create_nothing(tmp_path):
    assert files.check_output_file(tmp_path / "new" / "r.json") == tmp_path / "new" / "r.json"
    assert files.check_output_dir(tmp_path / "figs" / "a") == tmp_path / "figs" / "a"
    (tmp_path / "exists.json").write_text("{}")
    files.check_output_file(tmp_path / "exists.json")
    files.check_output_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.json"]


@pytest.mark.parametrize("case", ["file is a folder", "file under a file", "file empty", "dir is a file",
                                  "dir under a file", "dir empty", "file unwritable", "dir unwritable",
                                  "name too long"])
def test_check_output_paths_refuse(tmp_path, unwritable_dir, case):
    (tmp_path / "afile").write_text("x")
    check, path, needle = {
        "file is a folder": (files.check_output_file, tmp_path, "is a folder"),
        "file under a file": (files.check_output_file, tmp_path / "afile" / "r.json", "afile is a file"),
        "file empty": (files.check_output_file, "", "must be a file path"),
        "dir is a file": (files.check_output_dir, tmp_path / "afile", "a folder is needed"),
        "dir under a file": (files.check_output_dir, tmp_path / "afile" / "figs", "afile is a file"),
        "dir empty": (files.check_output_dir, " ", "must be a folder path"),
        "file unwritable": (files.check_output_file, unwritable_dir / "sub" / "r.json", "cannot write in"),
        "dir unwritable": (files.check_output_dir, unwritable_dir / "figs", "cannot write in"),
        "name too long": (files.check_output_file, tmp_path / ("b" * 252 + ".json"), "257 bytes long, more than"),
    }[case]
    with pytest.raises(ValueError, match=needle) as info:
        check(path, option="--the-option")
    assert str(info.value).startswith("--the-option")


@pytest.mark.parametrize("field, option", [("json_path", "--json"), ("figures_dir", "--figures-dir"),
                                           ("trace_out", "--trace-out")])
def test_compare_config_checks_output_paths(tmp_path, field, option):
    (tmp_path / "afile").write_text("x")
    bad = tmp_path if field == "json_path" else tmp_path / "afile"
    with pytest.raises(ValueError, match=option):
        CompareConfig(model="tiny-random-llama", **{"figures_dir": None, field: str(bad)})


# ----------------------------------------------------------------------------- trace files

def _row(**over):
    row = {"request_id": "r0", "prompt_token_ids": [5, 6, 7], "max_new_tokens": 4,
           "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None, "ignore_eos": True},
           "arrival_time_s": 0.0, "prompt_text": None, "priority": 0}
    row.update(over)
    return row


def _trace(*rows):
    return json.dumps({"format": TRACE_FORMAT, "requests": list(rows) or [_row()]})


def _without(key):
    row = _row()
    del row[key]
    return row


BAD_TRACES = {  # case -> (file content: str or bytes, words the message must contain)
    "empty file": ("", ["empty"]),
    "whitespace only": ("  \n", ["empty"]),
    "truncated JSON": (_trace()[:40], ["not a JSON trace", "line 1"]),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", ["not UTF-8"]),
    "NaN literal": (_trace().replace('"arrival_time_s": 0.0', '"arrival_time_s": NaN'),
                    ["requests[0].arrival_time_s is NaN", "finite number", "leave an optional field out"]),
    "Infinity in a later request": (_trace(_row(), _row(request_id="r1")).replace(
        '"priority": 0}]', '"priority": -Infinity}]'), ["requests[1].priority is -Infinity"]),
    "sampling an empty list": (_trace(_row(sampling=[])), ["request 0", "sampling must be an object"]),
    "top-level list": ("[1, 2]", ["JSON object", "list"]),
    "top-level string": ('"trace"', ["JSON object", "str"]),
    "missing format": (json.dumps({"requests": [_row()]}), ["'format'"]),
    "wrong format": (json.dumps({"format": "minibatch-trace-v0", "requests": [_row()]}), ["format", TRACE_FORMAT]),
    "missing requests": (json.dumps({"format": TRACE_FORMAT}), ["'requests'"]),
    "requests not a list": (json.dumps({"format": TRACE_FORMAT, "requests": {"a": 1}}), ["'requests'", "list"]),
    "zero requests": (json.dumps({"format": TRACE_FORMAT, "requests": []}), ["'requests' is empty", ">= 1"]),
    "unknown top-level key": (json.dumps({"format": TRACE_FORMAT, "requests": [_row()], "x": 1}), ["'x'"]),
    "request not an object": (_trace(_row(), [1, 2]), ["request 1", "object"]),
    "missing request_id": (_trace(_without("request_id")), ["request 0", "request_id"]),
    "missing prompt_token_ids": (_trace(_without("prompt_token_ids")), ["request 0", "prompt_token_ids"]),
    "missing max_new_tokens": (_trace(_without("max_new_tokens")), ["request 0", "max_new_tokens"]),
    "unknown request field": (_trace(_row(max_tokens=3)), ["request 0", "'max_tokens'"]),
    "request_id int": (_trace(_row(request_id=7)), ["request 0", "request_id", "non-empty string"]),
    "request_id empty": (_trace(_row(request_id="")), ["request 0", "request_id"]),
    "duplicate request_id": (_trace(_row(), _row(request_id="r1"), _row()), ["request 2", "'r0'", "request 0"]),
    "prompt empty": (_trace(_row(prompt_token_ids=[])), ["request 0", "prompt_token_ids", ">= 1 token id"]),
    "prompt not a list": (_trace(_row(prompt_token_ids="5 6 7")), ["request 0", "prompt_token_ids"]),
    "prompt float id": (_trace(_row(prompt_token_ids=[5, 6.5])), ["request 0", "prompt_token_ids[1]", "int"]),
    "prompt integral float": (_trace(_row(prompt_token_ids=[5.0])), ["prompt_token_ids[0]", "int"]),
    "prompt bool id": (_trace(_row(prompt_token_ids=[5, True])), ["prompt_token_ids[1]", "int"]),
    "prompt string id": (_trace(_row(prompt_token_ids=["5"])), ["prompt_token_ids[0]", "int"]),
    "prompt nested list": (_trace(_row(prompt_token_ids=[[5, 6]])), ["prompt_token_ids[0]", "int"]),
    "prompt negative id": (_trace(_row(prompt_token_ids=[5, -1])), ["prompt_token_ids[1]", ">= 0"]),
    "max_new_tokens 0": (_trace(_row(max_new_tokens=0)), ["request 0", "max_new_tokens", "[1, 1048576]"]),
    "max_new_tokens fractional": (_trace(_row(max_new_tokens=2.5)), ["max_new_tokens", "int"]),
    "max_new_tokens bool": (_trace(_row(max_new_tokens=True)), ["max_new_tokens", "int"]),
    "max_new_tokens string": (_trace(_row(max_new_tokens="4")), ["max_new_tokens", "int"]),
    "max_new_tokens huge": (_trace(_row(max_new_tokens=10**12)), ["request 0", "max_new_tokens"]),
    "arrival negative": (_trace(_row(arrival_time_s=-1.0)), ["arrival_time_s", "finite number in [0.0, 1000000000.0]"]),
    "arrival overflow to inf": (_trace().replace('"arrival_time_s": 0.0', '"arrival_time_s": 1e999'),
                                ["arrival_time_s", "finite"]),
    "arrival string": (_trace(_row(arrival_time_s="0")), ["arrival_time_s"]),
    "arrival bool": (_trace(_row(arrival_time_s=False)), ["arrival_time_s"]),
    "sampling not an object": (_trace(_row(sampling=[0.5])), ["request 0", "sampling must be an object"]),
    "sampling unknown key": (_trace(_row(sampling={"temprature": 0.5})), ["sampling", "'temprature'", "temperature"]),
    "sampling temperature string": (_trace(_row(sampling={"temperature": "hot"})), ["sampling.temperature"]),
    "sampling temperature negative": (_trace(_row(sampling={"temperature": -1})), ["request 0", "temperature"]),
    "sampling top_p 0": (_trace(_row(sampling={"top_p": 0.0})), ["request 0", "top_p"]),
    "sampling top_k float": (_trace(_row(sampling={"top_k": 2.5})), ["sampling.top_k", "int"]),
    "sampling seed string": (_trace(_row(sampling={"seed": "1"})), ["sampling.seed"]),
    "sampling ignore_eos int": (_trace(_row(sampling={"ignore_eos": 1})), ["sampling.ignore_eos"]),
    "priority float": (_trace(_row(priority=1.5)), ["request 0", "priority", "int"]),
    "priority bool": (_trace(_row(priority=True)), ["priority", "int"]),
    "prompt_text number": (_trace(_row(prompt_text=3)), ["prompt_text"]),
}


@pytest.mark.parametrize("case", BAD_TRACES)
def test_bad_trace_file(tmp_path, case):
    content, words = BAD_TRACES[case]
    path = tmp_path / "trace.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as info:
        load_trace(path)
    msg = str(info.value)
    assert msg.startswith(str(path)) and "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("case", ["missing", "folder"])
def test_trace_path_not_a_file(tmp_path, case):
    path = tmp_path / "nope.json" if case == "missing" else tmp_path
    with pytest.raises(ValueError, match="no such trace file" if case == "missing" else "is a folder") as info:
        load_trace(path)
    assert str(path) in str(info.value)


def test_trace_round_trip_is_strict_and_exact(tmp_path):
    reqs = _requests()
    save_trace(reqs, tmp_path / "t.json")
    strict_loads((tmp_path / "t.json").read_text())
    back = load_trace(tmp_path / "t.json", vocab_size=10)
    assert [(r.request_id, r.prompt_token_ids, r.max_new_tokens, r.sampling, r.arrival_time_s) for r in back] == \
           [(r.request_id, r.prompt_token_ids, r.max_new_tokens, r.sampling, r.arrival_time_s) for r in reqs]


def test_save_trace_refuses_what_load_refuses(tmp_path):
    with pytest.raises(ValueError, match=">= 1 request"):
        save_trace([], tmp_path / "t.json")
    r = _requests()[0]
    object.__setattr__(r, "arrival_time_s", math.inf)  # past Request's own check
    with pytest.raises(ValueError, match="'a'.*arrival_time_s"):
        save_trace([r], tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_trace_ids_checked_against_the_vocab(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(_trace(_row(), _row(request_id="r1", prompt_token_ids=[5, 64])))
    with pytest.raises(ValueError) as info:
        load_trace(path, vocab_size=64)
    msg = str(info.value)
    assert str(path) in msg and "request 1" in msg and "prompt_token_ids[1]" in msg and "[0, 64)" in msg
    cfg = CompareConfig(model="tiny-random-llama", trace=str(path), figures_dir=None)
    with pytest.raises(ValueError, match=r"request 1: prompt_token_ids\[1\] must be in \[0, 64\)"):
        build_trace(cfg, None, vocab_size=64)
    assert [r.request_id for r in build_trace(cfg, None, vocab_size=65)] == ["r0", "r1"]


@pytest.mark.parametrize("option, value", [("num_requests", 3), ("rate", 5.0), ("arrival", "zero"),
                                           ("max_output_len", 9), ("output_scale", 1.0), ("long_prompts", 1)])
def test_generator_options_are_refused_with_a_trace(tmp_path, option, value):
    """They shape a generated trace; with --trace they were silently ignored (as are the multiturn workload's)."""
    path = tmp_path / "t.json"
    path.write_text(_trace(_row()))
    with pytest.raises(ValueError, match=f"--{option.replace('_', '-')} shapes a generated trace"):
        CompareConfig(model="tiny-random-llama", trace=str(path), figures_dir=None, **{option: value})
    cfg = CompareConfig(model="tiny-random-llama", trace=str(path), figures_dir=None, seed=3,  # seeds the sim
                        clock="sim", profile=str(COMMITTED_PROFILE))
    with pytest.raises(ValueError, match="--trace does not apply with --workload multiturn"):
        simulate(cfg, ClusterConfig(workload="multiturn"))


def test_compare_config_reads_the_trace_before_any_model_loads(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(_trace(_row(max_new_tokens=1.5)))
    with pytest.raises(ValueError, match=r"t\.json: request 0: max_new_tokens"):
        CompareConfig(model="tiny-random-llama", trace=str(path), figures_dir=None)


# ----------------------------------------------------------------------------- profile files

def _good_profile() -> dict:
    return json.loads(COMMITTED_PROFILE.read_text())


def _set(d: dict, dotted: str, value):
    *parents, last = dotted.split(".")
    for p in parents:
        d = d[p]
    if value is _DELETE:
        del d[last]
    else:
        d[last] = value


_DELETE = object()
BAD_PROFILES = {  # case -> (changes {dotted key: value or _DELETE} or raw text, words the message must contain)
    "malformed JSON": ('{"format": "minibatch-profile-v1", "model": ', ["not a JSON profile"]),
    "empty": ("", ["empty"]),
    "not an object": ("[1, 2, 3]", ["not a profile", "list"]),
    "no format (older)": ({"format": _DELETE}, ["no 'format' key", "calibrate"]),
    "old version": ({"format": "minibatch-profile-v0"}, ["another version", "minibatch-profile-v1", "calibrate"]),
    "other format": ({"format": "minibatch-trace-v1"}, ["format must be", "calibrate"]),
    "missing model": ({"model": _DELETE}, ["'model'", "calibrate"]),
    "model not a string": ({"model": 3}, ["'model'", "string"]),
    "missing layouts": ({"layouts": _DELETE}, ["'layouts'", "packed"]),
    "layouts a list": ({"layouts": []}, ["'layouts'"]),
    "no packed layout": ({"layouts.packed": _DELETE}, ["'layouts'", "packed"]),
    "unknown layout": ({"layouts.sideways": {}}, ["'layouts'"]),
    "renamed coef key (older)": ({"layouts.packed.coef_s.decode_attention": _DELETE}, ["layouts.packed", "coef_s"]),
    "layout key renamed": ({"layouts.padded.curve_s": _DELETE}, ["layouts.padded", "curve_s"]),
    "curve wrong length": ({"layouts.packed.curve_s": [0.1]}, ["layouts.packed", "curve_s"]),
    "curve null (was NaN)": ({"layouts.packed.curve_s": [None] * 14}, ["curve_s", "(0, 3600]"]),
    "curve negative": ({"layouts.packed.curve_s": [-0.1] * 14}, ["layouts.packed", "curve_s", "(0, 3600]"]),
    "curve huge": ({"layouts.packed.curve_s": [1e308] * 14}, ["layouts.packed", "curve_s"]),
    "coef negative": ({"layouts.packed.coef_s.logits": -1e-3}, ["coef_s['logits']", "[0, 3600]"]),
    "knots not increasing": ({"layouts.packed.knots": [2, 1]}, ["layouts.packed", "knots"]),
    "coef string": ({"layouts.packed.coef_s.logits": "0.1"}, ["coef_s", "a number in"]),
    "draft wrong type": ({"draft": [1, 2]}, ["'draft'", "knots"]),
    "vocab_size bool": ({"vocab_size": True}, ["'vocab_size'", "int >= 1"]),
    "vocab_size 0": ({"vocab_size": 0}, ["'vocab_size'"]),
    "max_model_len string": ({"max_model_len": "8192"}, ["'max_model_len'", "int >= 1", "context limit"]),
    "samples not a list": ({"samples": {}}, ["'samples'", "list", "calibrate"]),
    "sample missing key": ({"samples": [{"scenario": "x", "layout": "packed", "time_s": 0.1}]},
                           ["'samples'", "sample 0", "num_tokens"]),
    "sample time 0": ({"samples": [{**_good_profile()["samples"][0], "time_s": 0}]}, ["sample 0", "time_s"]),
    "draft sample not object": ({"draft_samples": [3]}, ["'draft_samples'", "sample 0", "forwards"]),
}


@pytest.mark.parametrize("case", BAD_PROFILES)
def test_bad_profile_file(tmp_path, case):
    change, words = BAD_PROFILES[case]
    path = tmp_path / "profile.json"
    if isinstance(change, str):
        path.write_text(change)
    else:
        data = _good_profile()
        for key, value in change.items():
            _set(data, key, value if value is _DELETE else copy.deepcopy(value))
        path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        Profile.load(path)
    msg = str(info.value)
    assert msg.startswith(str(path)) and "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    if not isinstance(change, str):
        assert "re-run python -m minibatch calibrate" in msg or "set it to the model's" in msg


def test_committed_profile_loads_and_saves_identically(tmp_path):
    p = Profile.load(COMMITTED_PROFILE)
    assert p.vocab_size == 49152 and set(p.layouts) == {"packed", "padded"} and p.draft is not None
    assert p.save(tmp_path / "again.json").read_bytes() == COMMITTED_PROFILE.read_bytes()


def test_profile_without_optional_keys(tmp_path):
    """No draft, no vocab_size, no samples: loads; what needs them says what to do."""
    data = _good_profile()
    for key in ("draft", "vocab_size", "samples", "draft_samples"):
        del data[key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    p = Profile.load(path)
    assert p.draft is None
    with pytest.raises(ValueError, match="old.json: no 'vocab_size' key.*calibrate"):
        p.vocab_size
    from minibatch.sim.calibrate import refit

    with pytest.raises(ValueError, match="old.json: no stored 'samples'.*calibrate"):
        refit(p)


def test_profile_save_is_strict(tmp_path):
    p = _profile()
    p.meta["fit_error"] = {"packed": {"median": math.nan}}
    strict_loads(p.save(tmp_path / "p.json").read_text())
    assert Profile.load(tmp_path / "p.json").meta["fit_error"] == {"packed": {"median": None}}


@pytest.mark.parametrize("case", ["missing", "folder", "binary"])
def test_profile_path_not_a_profile(tmp_path, case):
    path = {"missing": tmp_path / "nope.json", "folder": tmp_path, "binary": tmp_path / "b.json"}[case]
    if case == "binary":
        path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="profile") as info:
        Profile.load(path)
    assert str(path) in str(info.value)


# ----------------------------------------------------------------------------- the converted-model cache

@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """An empty $MINIBATCH_CACHE whose "GGUF" is the tiny random Llama (milliseconds, not 20 s);
    yields the list that counts conversions."""
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))
    conversions = []

    def fake_gguf():
        conversions.append(1)
        return models.load_model("tiny-random-llama")

    monkeypatch.setattr(gguf, "load_smollm2_from_gguf", fake_gguf)
    return conversions


def _old(path: Path, seconds: float = 3600) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_stale_temp_dirs_are_removed_live_ones_kept(tmp_path, fake_cache):
    fcntl = pytest.importorskip("fcntl")

    prefix = ".smollm2-135m-instruct.tmp-"
    dead_old = tmp_path / f"{prefix}old"  # killed before locking, an hour ago
    dead_locked = tmp_path / f"{prefix}dead"  # its lock file is there, nobody holds it: the owner died
    fresh = tmp_path / f"{prefix}fresh"  # just created by a conversion that has not locked yet
    live = tmp_path / f"{prefix}live"  # another process is converting right now (old, but locked)
    other = tmp_path / "unrelated"
    for d in (dead_old, dead_locked, fresh, live, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 100)
    (dead_locked / ".lock").touch()
    (live / ".lock").touch()
    _old(dead_old), _old(live), _old(other)
    with open(live / ".lock") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        gguf.load_smollm2()
        assert sorted(p.name for p in tmp_path.iterdir()) == \
               sorted([fresh.name, live.name, other.name, "smollm2-135m-instruct"])
    assert fake_cache == [1]


def test_a_conversion_holds_its_lock_while_writing(fake_cache, tmp_path, monkeypatch):
    """Even an old-looking temp dir is kept while its conversion runs (the lock, not the age)."""
    from transformers import PreTrainedTokenizerFast

    seen = []
    save = PreTrainedTokenizerFast.save_pretrained

    def spy(self, directory, *args, **kwargs):
        _old(Path(directory))
        seen.append((gguf._is_stale_temp_dir(Path(directory)), gguf._remove_stale_temp_dirs(
            gguf.smollm2_cache_path())))
        return save(self, directory, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", spy)
    gguf.load_smollm2()
    assert seen == [(False, [])]
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m-instruct"]
    assert not (tmp_path / "smollm2-135m-instruct" / ".lock").exists()


def test_killed_conversion_leaves_a_dir_the_next_load_removes(fake_cache, tmp_path):
    """A process holding a temp dir's lock is SIGKILLed: the lock goes with it, the dir is removed."""
    import signal
    import subprocess
    import sys

    pytest.importorskip("fcntl")
    tmp = tmp_path / ".smollm2-135m-instruct.tmp-killed"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"\0" * 1000)
    child = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(120)", str(tmp / ".lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        assert gguf._remove_stale_temp_dirs(gguf.smollm2_cache_path()) == []  # alive: kept
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
        child.stdout.close()
    gguf.load_smollm2()
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m-instruct"]


def _truncate(path: Path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


DAMAGE = {  # case -> (damage(path), words of the problem)
    "truncated safetensors": (_truncate, "model.safetensors is"),
    "safetensors 3 bytes": (lambda p: (p / "model.safetensors").write_bytes(b"abc"), "truncated"),
    "safetensors header garbage": (lambda p: (p / "model.safetensors").write_bytes(
        (16).to_bytes(8, "little") + b"not json at all!" + b"\0" * 64), "damaged header"),
    "missing safetensors": (lambda p: (p / "model.safetensors").unlink(), "model.safetensors is missing"),
    "missing config": (lambda p: (p / "config.json").unlink(), "config.json is missing"),
    "config not JSON": (lambda p: (p / "config.json").write_text('{"vocab_size": 5'), "config.json is not valid JSON"),
    "tokenizer config missing": (lambda p: (p / "tokenizer_config.json").unlink(), "tokenizer_config.json"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_cache_entry_is_converted_again(fake_cache, tmp_path, case, capsys):
    gguf.load_smollm2()
    entry = gguf.smollm2_cache_path()
    damage, words = DAMAGE[case]
    damage(entry)
    assert words in gguf.cache_entry_problem(entry)
    model, _ = gguf.load_smollm2()
    assert fake_cache == [1, 1] and gguf.cache_entry_problem(entry) is None
    err = capsys.readouterr().err
    assert str(entry) in err and words in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m-instruct"]


def test_damaged_cache_that_cannot_be_removed_names_the_directory(fake_cache, monkeypatch):
    gguf.load_smollm2()
    entry = gguf.smollm2_cache_path()
    _truncate(entry)

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(gguf.os, "replace", refuse)
    with pytest.raises(ValueError, match="delete that directory") as info:
        gguf.load_smollm2()
    assert str(entry) in str(info.value) and "model.safetensors" in str(info.value)


def test_cache_that_looks_complete_but_fails_to_load_names_the_directory(fake_cache):
    gguf.load_smollm2()
    entry = gguf.smollm2_cache_path()
    (entry / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ValueError, match="delete that directory") as info:
        gguf.load_smollm2()
    assert str(entry) in str(info.value)


def test_a_name_near_the_limit_is_written(tmp_path):
    """A 250-byte name passed the check and then failed after the run: its temp file's name was too long."""
    path = tmp_path / ("b" * 245 + ".json")
    files.check_output_file(path)
    files.write_json(path, {"a": 1})
    assert files.read_json(path) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_atomic_write_through_a_symlink_keeps_the_link(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert files.write_json(link, {"a": math.nan}) == link
    assert link.is_symlink() and strict_loads(target.read_text()) == {"a": None}


def test_the_converted_model_is_readable_by_everyone(fake_cache):
    """A class shares one cache: every file of the entry is world-readable (0o644), like its directory, also an
    entry converted before this rule (an owner-only file is opened up at the next load)."""
    gguf.load_smollm2()
    entry = gguf.smollm2_cache_path()
    files = [f for f in entry.iterdir() if f.is_file()]
    assert files and all(f.stat().st_mode & 0o777 == 0o644 for f in files)
    (entry / "model.safetensors").chmod(0o600)
    gguf.load_smollm2()
    assert (entry / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_optional_trace_fields_may_be_null(tmp_path):
    """null is JSON's "not given": an optional field that is null gets its default."""
    path = tmp_path / "t.json"
    path.write_text(_trace(_row(arrival_time_s=None, priority=None, sampling=None, prompt_text=None)))
    (r,) = load_trace(path)
    assert (r.arrival_time_s, r.priority, r.sampling) == (0.0, 0, SamplingParams())


def test_a_request_added_to_two_engines_is_refused_naming_it(tiny):
    """One engine owns a request's state: a second engine gets a clear error (not an invariant failure deep in the
    block manager once both have run it); a copy is welcome."""
    _, runner, prompts, _ = tiny
    first, second = make_engine("paged", runner, n_slots=256), make_engine("paged", runner, n_slots=256)
    req = Request("shared", prompts[0], 3, GREEDY)
    first.add_request(req)
    with pytest.raises(ValueError, match="'shared' was already added to another engine.*request.copy"):
        second.add_request(req)
    second.add_request(req.copy())
    first.generate([]), second.generate([])


@pytest.mark.parametrize("scale", [1e-6, 0.01, 0.1, 0.49])
def test_calibration_workloads_build_at_any_scale(scale):
    """Small scales used to draw a static batch's steps from an empty range (numpy: low >= high)."""
    from minibatch.sim.workloads import FULL, QUICK, scenarios

    for grid in (FULL, QUICK):
        work = scenarios(512, scale, grid=grid)
        assert work and all(r.max_new_tokens >= 1 and r.num_prompt_tokens >= 1 for sc in work for r in sc.requests)
    assert max(r.max_num_tokens for sc in scenarios(512, 0.49) for r in sc.requests) <= 512


@pytest.mark.parametrize("script, argv, message", [
    ("greedy_argmax.py", ["--rows", "0"], "argument --rows: must be an int in [1, 4096], got 0"),
    ("fused_layers.py", ["--batches", "1,,2"], "argument --batches: must be a comma-separated list"),
    ("cpu_decode.py", ["--against-source", "/no/such.cpp"], "--against-source /no/such.cpp: no such file"),
    ("vllm_peer.py", ["--rounds", "0"], "argument --rounds: must be an int in [1, 20], got 0"),
    ("vllm_peer.py", ["--num-requests", "0"], "argument --num-requests: must be an int in [1, 1000000], got 0"),
    ("validate_sim.py", ["--resimulate", "--measured", "README.md"], "README.md"),  # not JSON: found after parsing
])
def test_benchmark_scripts_refuse_bad_input_in_one_line(script, argv, message):
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / script), *argv], capture_output=True, text=True,
                          timeout=120, cwd=root, env=os.environ | {"PYTHONPATH": str(root)})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(f"{script}: error: ")
