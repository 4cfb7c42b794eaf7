"""vLLM as a peer (``minibatch.baselines.vllm_peer``): what it is given, how its results fill our requests, and
that compare skips it with one line where vLLM is not installed. vLLM itself is never installed in CI: its run is
``benchmarks/vllm_peer.py``'s; here a stand-in interpreter plays the worker."""

import json
import platform
import statistics
import sys
from pathlib import Path

import pytest

from minibatch.__main__ import main
from minibatch.baselines import vllm_peer
from minibatch.baselines.vllm_peer import VllmConfig, run_vllm, vllm_job
from minibatch.metrics import summarize
from minibatch.models import load_model
from minibatch.request import Request, SamplingParams
from minibatch.runner import ModelRunner

ROOT = Path(__file__).resolve().parent.parent

FAKE_WORKER = '''#!{python}
import json, sys
job = json.load(open(sys.argv[2]))
out = {{"vllm_version": "fake", "load_s": 1.0, "warmup_s": 0.5, "run_time_s": 2.0, "requests": {{}}}}
for i, r in enumerate(job["requests"]):
    if r["request_id"] == "lost":
        continue
    n = r["max_tokens"]
    out["requests"][r["request_id"]] = {{"output_token_ids": [7] * n, "finish_reason": "length",
        "token_times_s": [0.1 * (i + 1) + 0.05 * k for k in range(n)],
        "logprobs": [{{"7": -0.5, "8": -1.5}}] * n if r["logprobs"] else []}}
json.dump(out, open(sys.argv[3], "w"))
'''


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random-llama", dtype="float32")


def fake_python(tmp_path):
    path = tmp_path / "fake-python"
    path.write_text(FAKE_WORKER.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def test_vllm_gets_the_same_settings_and_inputs(tiny, tmp_path):
    model, tok = tiny
    reqs = [Request("a", [5, 6, 7], 4, SamplingParams(ignore_eos=True)), Request("b", [9] * 10, 6, arrival_time_s=0.5)]
    job = vllm_job(model, reqs, VllmConfig(max_num_seqs=32, n_slots=1000, max_num_batched_tokens=256), "DIR")
    engine = job["engine"]
    assert engine["model"] == "DIR" and engine["dtype"] == "float32" and engine["max_num_seqs"] == 32
    assert engine["kv_cache_memory_bytes"] == 1000 * ModelRunner(model, tok).kv_bytes_per_token  # same KV bytes
    assert engine["max_num_batched_tokens"] == 256 and engine["enable_prefix_caching"] is False
    assert engine["enforce_eager"] is False  # vLLM's default, compiled mode
    a, b = job["requests"]
    assert a["prompt_token_ids"] == [5, 6, 7] and a["max_tokens"] == 4 and a["stop_token_ids"] == []
    assert b["stop_token_ids"] == list(ModelRunner(model, tok).eos_token_ids) and b["arrival_time_s"] == 0.5
    with pytest.raises(ValueError, match="request 's' samples: the vllm peer runs greedy traces"):
        vllm_job(model, [Request("s", [5, 6], 3, SamplingParams(temperature=0.7, seed=1))], VllmConfig(), "DIR")


def test_compare_enforce_eager_reaches_vllm():
    """--enforce-eager is compare's (ModelConfig's) option, one for both engines: vLLM's config must get it (a
    setting merged into the policies' settings was dropped: the peer's field is not a command-line setting)."""
    from minibatch.compare import compare_config

    reqs = [Request("a", [5, 6, 7], 4, SamplingParams(ignore_eos=True))]
    for eager in (False, True):
        cfg = compare_config({"model": "tiny-random-llama", "policies": "paged,vllm", "enforce_eager": eager},
                             "model", {})
        assert cfg.policy_config("vllm", reqs).enforce_eager is eager
        assert not hasattr(cfg.policy_config("paged", reqs), "enforce_eager")


def test_its_results_fill_our_requests_like_any_run(tiny, tmp_path):
    model, _ = tiny
    reqs = [Request(f"r{i}", [5 + i, 6, 7], 3, SamplingParams(ignore_eos=True, logprobs=1)) for i in range(2)]
    done, extra = run_vllm(model, reqs, VllmConfig(vllm_python=fake_python(tmp_path)))
    assert [r.output_token_ids for r in done] == [[7, 7, 7], [7, 7, 7]] and all(r.is_finished for r in done)
    assert done[1].token_times_s == pytest.approx([0.2, 0.25, 0.3]) and done[0].logprobs[0] == {7: -0.5, 8: -1.5}
    summary = summarize(done)
    assert summary.ttft_p50_s == pytest.approx(0.15) and summary.total_output_tokens == 6
    assert extra["peer"]["engine"] == "vllm" and extra["peer"]["settings"]["max_num_seqs"] == 8
    with pytest.raises(RuntimeError, match="request 'lost': vllm returned no finished output"):
        run_vllm(model, [Request("lost", [5, 6], 2, SamplingParams(ignore_eos=True))],
                 VllmConfig(vllm_python=fake_python(tmp_path)))


def test_compare_skips_vllm_with_one_line_when_it_is_not_installed(tmp_path, capsys, monkeypatch, one_thread):
    monkeypatch.setattr(vllm_peer.importlib.util, "find_spec", lambda name: None)
    out = tmp_path / "out.json"
    main(["compare", "--model", "tiny-random-llama", "--policies", "paged,vllm", "--num-requests", "4", "--clock",
          "sim", "--max-output-len", "8", "--figures-dir", "", "--no-progress", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "vllm: skipped: vllm is not installed in this environment and --vllm-python is not given" in printed
    assert list(json.loads(out.read_text())["policies"]) == ["paged"]
    with pytest.raises(ValueError, match="--vllm-python /no/such/python: no such file"):
        VllmConfig(vllm_python="/no/such/python")  # given but wrong: refused before any run, not skipped after
    not_executable = tmp_path / "python"
    not_executable.write_text("")
    with pytest.raises(ValueError, match="not executable"):
        VllmConfig(vllm_python=str(not_executable))
    for bad, what in (("/no/such/python", "no such file"), (str(not_executable), "not executable")):
        with pytest.raises(SystemExit) as e:
            main(["compare", "--model", "tiny-random-llama", "--policies", "paged,vllm", "--vllm-python", bad])
        assert e.value.code == 2 and what in capsys.readouterr().err


PHASED_WORKER = '''#!{python}
import json, sys
job = json.load(open(sys.argv[2]))
phases = []
for requests in job["phases"]:
    out = {{}}
    for i, r in enumerate(requests):  # prefills end at 0.3 + 0.1 i; then a decode step every 0.02 s
        n = r["max_tokens"]
        out[r["request_id"]] = {{"output_token_ids": [7] * n, "finish_reason": "length", "logprobs": [],
                                 "token_times_s": [0.3 + 0.1 * i] + [0.3 + 0.1 * (len(requests) - 1) + 0.02 * k
                                                                     for k in range(1, n)]}}
    phases.append({{"run_time_s": 1.0, "requests": out}})
json.dump({{"vllm_version": "fake", "load_s": 1.0, "warmup_s": 0.5, "phases": phases}}, open(sys.argv[3], "w"))
'''


def phased_python(tmp_path) -> str:
    path = tmp_path / "phased-python"
    path.write_text(PHASED_WORKER.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def test_vllm_step_times_per_shape(tiny, tmp_path):
    """profile --vllm-python: one worker run with a phase per shape (each decode shape's requests together, each
    prefill repeated); a decode step is the gap between steps once every request has its first token, a prefill
    step the time to the lone request's token."""
    from minibatch.baselines.vllm_steps import add_vllm_steps, vllm_step_times

    model, _ = tiny
    shapes = [("decode", 1), ("decode", 4), ("prefill", 16)]
    times, peer = vllm_step_times(model, shapes, context_len=20, repeats=3, python=phased_python(tmp_path))
    assert times == pytest.approx([0.02, 0.02, 0.3]) and peer["version"] == "fake"
    assert peer["settings"]["max_num_seqs"] == 4 and peer["settings"]["enable_prefix_caching"] is False
    rows = [{"bound_s": 0.01, "step_s": 0.03} for _ in shapes]
    add_vllm_steps(rows, shapes, [times])
    assert [r["vllm_step_s"] for r in rows] == pytest.approx(times) and rows[0]["vllm_over_bound"] == 2.0
    assert rows[0]["ours_over_vllm"] == 1.5 and rows[2]["ours_over_vllm"] == 0.1


def test_vllm_step_rounds_pair_ours_with_theirs():
    """profile --rounds: vLLM's step is the median of its rounds, ours against it the median of the rounds' own
    ratios (each round's pair timed together), not the ratio of the medians."""
    from minibatch.baselines.vllm_steps import add_vllm_steps

    rows = [{"bound_s": 0.01, "step_s": 0.03, "round_step_s": [0.03, 0.05, 0.02]}]
    add_vllm_steps(rows, [("decode", 8)], [[0.02], [0.05], [0.04]])
    assert rows[0]["vllm_step_s"] == 0.04 and rows[0]["vllm_round_step_s"] == [0.02, 0.05, 0.04]
    assert rows[0]["ours_over_vllm"] == 1.0  # median of 1.5, 1.0, 0.5 (the medians' ratio would be 0.75)


def test_profile_rounds_alternate_with_vllm(tmp_path, one_thread, monkeypatch):
    """profile --rounds 2 --vllm-python: two rounds of ours, each followed by vLLM's; every row is its median
    round's, with both rounds' step times and probes, and vLLM's per round."""
    from minibatch.baselines import vllm_peer

    monkeypatch.setattr(vllm_peer, "lacks_vllm", lambda path: None)  # (the fake worker is no interpreter to ask)
    out = tmp_path / "profile.json"
    main(["profile", "--model", "tiny-random-llama", "--dtype", "float32", "--attention-backend", "sdpa",
          "--decode-batches", "2", "--prefill-lens", "16", "--context-len", "12", "--repeats", "2", "--rounds", "2",
          "--vllm-python", phased_python(tmp_path), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["rounds"] == 2 and result["vllm"]["version"] == "fake"
    for row in result["shapes"]:
        assert len(row["round_step_s"]) == 2 and row["step_s"] == min(row["round_step_s"])  # the lower middle
        assert len(row["paired"]["step_s"]) == 4 and len(row["vllm_round_step_s"]) == 2
        assert row["ours_over_vllm"] == pytest.approx(statistics.median(
            a / b for a, b in zip(row["round_step_s"], row["vllm_round_step_s"])), abs=0.001)


ENV_WORKER = '''#!{python}
import json, os, sys
json.dump({{k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}, open(sys.argv[3], "w"))
'''


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
@pytest.mark.parametrize("keep", ["1", "0"])
def test_vllm_runs_with_our_allocator_settings(tmp_path, monkeypatch, keep):
    """Both engines reuse freed memory alike: vLLM's processes get, as environment variables, the glibc malloc
    settings our engine runs with (``machine.keep_freed_memory``), and none when ours keeps glibc's defaults."""
    from minibatch import machine

    for key in machine.KEEP_FREED_MEMORY_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MINIBATCH_KEEP_FREED_MEMORY", keep)
    path = tmp_path / "env-python"
    path.write_text(ENV_WORKER.format(python=sys.executable))
    path.chmod(0o755)
    got = vllm_peer.run_worker(str(path), {"engine": {}}, tmp_path)
    assert got == (machine.KEEP_FREED_MEMORY_ENV if keep == "1" else {})


def test_peer_benchmark_alternates_rounds_and_reports_the_lower_ratio(tmp_path, monkeypatch):
    """benchmarks/vllm_peer.py: each round is one compare of (ours, vLLM, transformers) on the issue's trace, or on
    --num-requests of it; the summary gives each round's ratios and the lower of the rounds."""
    from benchmark_scripts import load_benchmark

    bench = load_benchmark("vllm_peer")
    calls, speeds = [], iter([(300.0, 150.0), (200.0, 160.0)])  # (ours, vLLM) per round; transformers 100

    def fake_compare(argv):
        calls.append(argv)
        ours, theirs = next(speeds)
        rows = {"chunked": ours, "vllm": theirs, "hf_generate_batch": 100.0}
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps({"contended": False, "policies": {
            k: {"output_throughput_tok_s": v, "matches_reference": True} for k, v in rows.items()}}))

    monkeypatch.setattr(bench, "minibatch_main", fake_compare)
    out = tmp_path / "peer.json"
    result = bench.main(["--num-requests", "3", "--vllm-python", sys.executable, "--json", str(out)])
    assert len(calls) == 2 and all(a[a.index("--num-requests") + 1] == "3" and a.count("--num-requests") == 1
                                   and a[a.index("--policies") + 1] == "chunked,vllm,hf_generate_batch"
                                   for a in calls)
    summary = json.loads(out.read_text())["summary"]
    assert summary == result["summary"] and summary["num_requests"] == 3
    assert [r["ours_over_vllm"] for r in summary["rounds"]] == [2.0, 1.25]
    assert summary["lowest_ours_over_vllm"] == 1.25 and summary["lowest_ours_over_hf_generate_batch"] == 2.0
