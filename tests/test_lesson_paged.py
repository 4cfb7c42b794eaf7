"""Notebook 04's measurements (minibatch.lessons.paged_kv) on real runs: paged KV wastes less than
Orca's reservation in the same memory, Orca reserving max_new_tokens ("orca_max") reserves exactly what it says,
prefix caching skips the shared blocks with unchanged outputs, copy-on-write saves the slots
counted by hand, both preemption modes finish every request, the kernels match their references,
and the benchmark script runs end to end (tiny random Llama and SimExecutor; a few seconds)."""

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from benchmark_scripts import load_benchmark  # noqa: E402
from minibatch import ModelRunner, Request, SamplingParams, SimClock, SimExecutor, make_engine  # noqa: E402
from minibatch.engine import StepRecord  # noqa: E402
from minibatch.records import StepEntry  # noqa: E402
from minibatch.experiments.kv_waste import waste_sweep  # noqa: E402
from minibatch.viz.paged_kv import draw_block_map, plot_waste_sweep  # noqa: E402
from minibatch.experiments.paged_kv import GREEDY  # noqa: E402
from minibatch.experiments.kv_sharing import (cow_experiment, prefix_caching_experiment,  # noqa: E402
                                              system_and_user_ids)
from minibatch.experiments.kv_waste import expected_kv_waste, reservation_vs_paged  # noqa: E402
from minibatch.experiments.kernel_check import kernel_check  # noqa: E402
from minibatch.experiments.preemption import preemption_experiment, recomputed_tokens  # noqa: E402
from minibatch.models import load_model  # noqa: E402
from minibatch.workload import make_trace  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def runner():
    model, tokenizer = load_model("tiny-random-llama")
    return ModelRunner(model, tokenizer)


def sharegpt_trace(n=40):
    return make_trace(n, arrival="poisson", rate_per_s=4, lengths="sharegpt", max_prompt_len=512,
                      max_output_len=512, seed=3)


# ------------------------------------------------------------------ reservation vs paged
def test_paged_wastes_less_and_runs_more_than_orca_in_the_same_memory():
    reqs = sharegpt_trace()
    row = reservation_vs_paged(reqs, SimExecutor(), SimClock, 4096, max_num_seqs=64, orca_max_new_tokens=1024)
    p = row["policies"]
    assert set(p) == {"orca", "paged", "paged_prefix", "orca_max"} and row["same_outputs"]
    assert p["paged"]["kv_waste_fraction"] < 0.05 < p["orca"]["kv_waste_fraction"] < p["orca_max"]["kv_waste_fraction"]
    assert p["paged"]["max_num_running"] > p["orca"]["max_num_running"] > p["orca_max"]["max_num_running"]
    # the waste summed over steps follows from the lengths alone (no preemption in orca)
    assert p["orca"]["kv_waste_fraction"] == pytest.approx(expected_kv_waste(reqs, "orca"), abs=1e-12)
    assert p["orca_max"]["kv_waste_fraction"] == pytest.approx(
        expected_kv_waste(reqs, "orca_max", reserve_new_tokens=1024), abs=1e-12)
    assert all(p[k]["num_preemptions"] == 0 for k in ("orca", "orca_max"))


def test_expected_paged_waste_is_exact_without_preemption():
    reqs = sharegpt_trace(20)
    row = reservation_vs_paged(reqs, SimExecutor(), SimClock, 1 << 16, max_num_seqs=64, policies=("paged",))
    assert row["policies"]["paged"]["num_preemptions"] == 0
    assert row["policies"]["paged"]["kv_waste_fraction"] == pytest.approx(
        expected_kv_waste(reqs, "paged", 16), abs=1e-12)


def variant_engine(variant: str, **kwargs):
    """A simulated engine for one of the experiment's VARIANTS (its policy row and settings)."""
    from minibatch.experiments.paged_kv import variant_options

    row, settings = variant_options(variant, **kwargs)
    return make_engine(row, SimExecutor(), SimClock(), **settings)


def test_orca_max_reserves_what_it_says():
    # prompt + max(max_new_tokens, 12) per request: 5 + 12 = 17, 9 + 14 = 23, 3 + 12 = 15 slots
    reqs = [Request(f"q{i}", [7] * p, n, GREEDY) for i, (p, n) in enumerate([(5, 3), (9, 14), (3, 1)])]
    engine = variant_engine("orca_max", n_slots=64, orca_max_new_tokens=12)
    scheduler = engine.scheduler
    assert [scheduler._reservation(r) for r in reqs] == [17, 23, 15]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        record = engine.step()
        expected = sum(scheduler._reservation(r) for r in scheduler.running)
        assert record.num_kv_slots_reserved == scheduler.n_rsrv == expected == scheduler.block_manager.num_used_blocks
    assert [r.num_output_tokens for r in reqs] == [3, 14, 1]  # generation still stops at the true length
    # in 48 slots q0 and q1 reserve 17 + 23 = 40, so q2 (15 more) waits for q0 to finish, although the
    # three hold only 5 + 9 + 3 = 17 tokens at step 0 (plain Orca would reserve 8 + 23 + 4 = 35 <= 48)
    small = variant_engine("orca_max", n_slots=48, orca_max_new_tokens=12)
    small.generate([r.copy() for r in reqs])
    assert {e.request_id for e in small.trace[0].entries} == {"q0", "q1"}
    plain = variant_engine("orca", n_slots=48)
    plain.generate([r.copy() for r in reqs])
    assert {e.request_id for e in plain.trace[0].entries} == {"q0", "q1", "q2"}
    with pytest.raises(ValueError, match="orca_max_new_tokens"):
        variant_engine("orca_max", n_slots=48)


def test_orca_max_that_cannot_fit_is_skipped_not_dropped():
    reqs = [Request(f"q{i}", [7] * 10, 5, GREEDY) for i in range(3)]
    row = reservation_vs_paged(reqs, SimExecutor(), SimClock, 64, block_size=4, orca_max_new_tokens=100)
    assert "n_slots is 64" in row["policies"]["orca_max"]["skipped"]
    assert row["policies"]["paged"]["num_requests"] == 3


# ------------------------------------------------------------------ prefix caching
def test_prefix_caching_skips_the_shared_blocks_with_the_same_outputs(runner):
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 512, (23,), generator=g).tolist()  # 5 full blocks of 4 + 3 tokens
    users = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (6, 9, 4, 7)]
    res = prefix_caching_experiment(runner, SimClock, system, users, max_new_tokens=5, gap_s=1.0, block_size=4,
                                    n_slots=512)
    assert res["same_outputs"] and res["num_shared_blocks"] == 5
    plain, cached = res["policies"]["paged"], res["policies"]["paged_prefix"]
    assert plain["prefix_cache_hit_rate"] == 0 and cached["num_prefix_hit_tokens"] == 3 * 5 * 4
    assert cached["prefix_cache_hit_rate"] == pytest.approx(60 / (4 * 23 + 26))
    assert plain["num_prefill_tokens"] - cached["num_prefill_tokens"] == 60
    later = res["requests"][1:]  # u0 computes the system prompt; u1..u3 find it cached
    assert all(r["prefill_tokens"] - r["prefill_tokens_prefix"] == 20 for r in later)
    assert all(r["ttft_prefix_s"] < r["ttft_s"] for r in later)


def test_system_and_user_ids_split_a_chat_rendering():
    class ChatTokenizer:  # renders "<s>ROLE:TEXT\n" turns; one token per character
        chat_template = "fake"

        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
            text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
            return text + ("<assistant>" if add_generation_prompt else "")

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    tok = ChatTokenizer()
    system, users = system_and_user_ids(tok, "be brief", ["hi", "why?"])
    assert system + users[1] == tok.encode("<system>be brief\n<user>why?\n<assistant>")
    _, plain_tok = load_model("tiny-random-llama")
    system, users = system_and_user_ids(plain_tok, "be brief", ["hi"])
    assert system + users[0] == plain_tok.encode("be brief\n\nhi", add_special_tokens=False)


# ------------------------------------------------------------------ copy-on-write
def test_cow_saves_exactly_the_hand_computed_slots(runner):
    # P = 10 prompt tokens in blocks of 4: positions 0-3 | 4-7 | 8-9. Each child shares blocks 0
    # and 1 and writes position 9 again (it samples its own first token), so it copies block 2.
    # Unshared: 4 requests x 3 blocks = 12 blocks = 48 slots while all four run (no block grows
    # until position 12). Forked: the parent's 3 blocks + one private copy per child = 6 blocks
    # = 24 slots. Saved: 3 children x 2 blocks x 4 slots = 24 slots.
    res = cow_experiment(runner, list(range(3, 13)), n=4, max_new_tokens=4, block_size=4, n_slots=256)
    assert (res["peak_slots_independent"], res["peak_slots_forked"], res["slots_saved"]) == (48, 24, 24)
    assert res["expected_slots_saved"] == 24 and res["num_blocks_copied"] == 3
    assert res["ref_cnts"] == {rid: [4, 4, 1] for rid in ("s", "s.1", "s.2", "s.3")}
    assert res["bytes_saved"] == 24 * runner.kv_bytes_per_token == 24 * 2 * 2 * 2 * 16 * 4  # 2 layers, 2 KV heads, fp32
    assert res["same_outputs"] and res["num_distinct_outputs"] == 1  # greedy: every sample alike


def test_cow_sampled_children_differ_but_match_their_unshared_twins(runner):
    res = cow_experiment(runner, list(range(3, 40)), n=3, max_new_tokens=8, block_size=4, n_slots=256,
                         sampling=SamplingParams(temperature=1.0, seed=1, ignore_eos=True))
    assert res["same_outputs"] and res["num_distinct_outputs"] == 3
    assert res["slots_saved"] == res["expected_slots_saved"] == 2 * 9 * 4


# ------------------------------------------------------------------ preemption
def test_both_preemption_modes_finish_every_request(runner):
    reqs = make_trace(10, arrival="zero", lengths="uniform", prompt_range=(8, 30), output_range=(8, 30),
                      vocab_size=512, seed=1)
    res = preemption_experiment(reqs, runner, SimClock, n_slots=96, block_size=4)
    assert res["same_outputs"]
    rec, swap = res["modes"]["recompute"], res["modes"]["swap"]
    for m in (rec, swap):
        assert m["num_requests"] == 10 and m["num_preemptions"] > 0 and m["num_preempted_requests"] > 0
    assert rec["recomputed_tokens"] > 0 and rec["num_blocks_swapped_out"] == 0
    assert swap["recomputed_tokens"] == 0 and swap["num_blocks_swapped_out"] == swap["num_blocks_swapped_in"] > 0
    assert swap["swapped_bytes"] == 2 * swap["num_blocks_swapped_out"] * 4 * runner.kv_bytes_per_token


def test_recomputed_tokens_counted_by_hand():
    r = Request("a", [1] * 5, 6, GREEDY)
    def step(i, phase, n, c):
        return StepRecord(i, 0, 1, [StepEntry("a", 0, phase, n, c)], 0, 0, 0, 0, 0, 1)
    # prefill 5, two decodes, preempted, then its 5 prompt + 3 generated tokens prefilled again
    trace = [step(0, "prefill", 5, 0), step(1, "decode", 1, 5), step(2, "decode", 1, 6), step(3, "prefill", 8, 0)]
    assert recomputed_tokens(trace, [r]) == 8


# ------------------------------------------------------------------ kernels, figures, exercise
def test_kernel_check_matches_the_references():
    res = kernel_check()
    if "skipped" in res:
        pytest.skip(res["skipped"])
    for name in ("store_kv", "decode", "prefill"):
        assert res[f"{name}_max_abs_diff"] < 1e-5
        assert res["timings_ms"][f"{name}_triton"] > 0


def test_figures_draw_what_they_say(runner):
    sweep = waste_sweep(sharegpt_trace(12), SimExecutor(), SimClock, [2048, 4096], max_num_seqs=32,
                                 policies=("orca", "paged"), orca_max_new_tokens=1024)
    fig = plot_waste_sweep(sweep)
    ax_waste, ax_running = fig.axes
    assert len(ax_waste.lines) == 4 and len(ax_running.lines) == 3  # 3 policies (+ the paper's vLLM line)
    plt.close(fig)
    reqs = [Request(f"r{i}", list(range(3, 3 + p)), n, GREEDY, arrival_time_s=0.0)
            for i, (p, n) in enumerate([(10, 10), (6, 18), (13, 7)])]
    engine = make_engine("paged", runner, SimClock(), max_num_seqs=8, n_slots=32, block_size=4)
    engine.generate(reqs)
    preempting = [s.step for s in engine.trace if s.preempted]
    assert preempting
    fig = draw_block_map(engine.trace, 8)
    assert [line.get_xdata()[0] for line in fig.axes[0].lines] == preempting
    plt.close(fig)


def test_benchmark_script_runs_quick(tmp_path):
    bench = load_benchmark("paged_kv")
    out = tmp_path / "paged_kv.json"
    result = bench.main(["--model", "tiny-random-llama", "--quick", "--clock", "sim", "--threads", "1",
                         "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("python benchmarks/paged_kv.py --model tiny-random-llama --quick")
    assert saved["environment"]["torch_threads"] == 1
    assert all(row["same_outputs"] for row in result["reservation_vs_paged"])
    assert result["prefix_caching"]["same_outputs"] and result["preemption"]["same_outputs"]
    assert result["copy_on_write"]["slots_saved"] == result["copy_on_write"]["expected_slots_saved"] > 0
    assert result["preemption"]["modes"]["recompute"]["num_preemptions"] > 0
