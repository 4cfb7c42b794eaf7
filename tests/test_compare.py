"""The main job's command line: options, errors and the JSON it writes."""

import json

import pytest

from minibatch.__main__ import main
from minibatch.compare import CompareConfig

KEYS = {"output_throughput_tok_s", "total_throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
        "tpot_p99_s", "e2e_p50_s", "matches_reference"}


def test_compare_tiny_writes_json_and_figures(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["compare", "--dtype", "float32", "--model", "tiny-random-llama", "--num-requests", "6", "--rate", "50",
               "--max-output-len", "12", "--max-prompt-len", "24", "--no-progress",
               "--policies", "static,orca,hf_generate", "--json", str(out), "--figures-dir", str(tmp_path / "fig")])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "tiny-random-llama" and result["num_requests"] == 6
    assert set(result["policies"]) == {"static", "orca", "hf_generate"}
    for entry in result["policies"].values():
        assert KEYS <= set(entry)
        assert entry["matches_reference"] is True
        assert entry["output_throughput_tok_s"] > 0
    assert sorted(p.name for p in (tmp_path / "fig").iterdir()) == [
        "compare_gantt.png", "compare_latency_cdf.png", "compare_throughput_latency.png"]
    assert "orca / static output throughput" in capsys.readouterr().out


def test_sim_clock_run_is_deterministic(tmp_path):
    args = ["compare", "--model", "tiny-random-gpt2", "--num-requests", "5", "--max-output-len", "8",
            "--max-prompt-len", "16", "--no-progress", "--policies", "static,orca", "--clock", "sim",
            "--figures-dir", ""]
    results = []
    for i in range(2):
        main(args + ["--json", str(tmp_path / f"{i}.json")])
        results.append(json.loads((tmp_path / f"{i}.json").read_text()))
    for r in results:
        r.pop("command"), r.pop("environment")  # the machine's load, sampled at the run's start and end
        r["config"].pop("command"), r["config"].pop("json_path")
        for entry in r["policies"].values():
            entry.pop("run_time_s")
    assert results[0] == results[1]


def test_compare_paged_policies(tmp_path, capsys):
    out = tmp_path / "r.json"
    main(["compare", "--dtype", "float32", "--model", "tiny-random-llama", "--num-requests", "8", "--arrival",
          "zero", "--clock", "sim",
          "--max-output-len", "12", "--max-prompt-len", "24", "--no-progress", "--n-slots", "96", "--block-size", "4",
          "--policies", "orca,paged,paged_prefix", "--reserve-new-tokens", "12", "--preemption-mode", "swap",
          "--json", str(out), "--figures-dir", str(tmp_path / "fig")])
    result = json.loads(out.read_text())
    assert result["config"]["settings"] == {"n_slots": 96, "block_size": 4, "reserve_new_tokens": 12,
                                            "preemption_mode": "swap"}
    p = result["policies"]  # each policy's settings: the ones it has
    assert p["orca"]["settings"]["reserve_new_tokens"] == 12 and "preemption_mode" not in p["orca"]["settings"]
    assert p["paged"]["settings"]["preemption_mode"] == "swap" and p["paged"]["settings"]["block_size"] == 4
    assert all(entry["matches_reference"] is True for entry in p.values())
    assert p["paged"]["kv_waste_fraction"] < p["orca"]["kv_waste_fraction"]
    assert p["paged"]["max_num_running"] > p["orca"]["max_num_running"]
    assert 0 <= p["paged_prefix"]["prefix_cache_hit_rate"] <= 1
    assert (tmp_path / "fig" / "compare_kv_block_map.png").is_file()
    printed = capsys.readouterr().out
    assert "paged / orca output throughput" in printed
    assert "clock: simulated by CostModel's default coefficients" in printed  # no --profile: it says whose times


@pytest.mark.parametrize("order", ["fcfs", "sjf", "priority"])
def test_compare_chunked_on_the_long_prompt_trace(tmp_path, capsys, order):
    out = tmp_path / "r.json"
    main(["compare", "--dtype", "float32", "--model", "tiny-random-llama", "--num-requests", "8", "--clock", "sim",
          "--rate", "20",
          "--max-output-len", "12", "--max-prompt-len", "24", "--no-progress", "--long-prompts", "2",
          "--long-prompt-len", "200", "--max-num-batched-tokens", "32", "--queue-policy", order,
          "--policies", "prefill_first,chunked,chunked_prefix", "--json", str(out), "--figures-dir", ""])
    result = json.loads(out.read_text())
    assert result["config"]["settings"] == {"max_num_batched_tokens": 32, "queue_policy": order}
    p = result["policies"]  # the budget is chunked prefill's setting: prefill_first has none
    assert [p[name]["settings"].get("max_num_batched_tokens") for name in p] == [None, 32, 32]
    assert {p[name]["settings"]["queue_policy"] for name in p} == {order}
    assert all(entry["matches_reference"] is True for entry in p.values())
    assert p["chunked"]["itl_p99_s"] < p["prefill_first"]["itl_p99_s"]  # the 200-token prefills no longer stall
    assert "chunked / prefill_first output throughput: " in (out := capsys.readouterr().out) and "ITL p99: " in out


@pytest.mark.parametrize("adaptive", [False, True])
def test_compare_speculative_policies(tmp_path, capsys, adaptive):
    """spec (tiny models: the target drafts for itself) and spec_ngram: exact, with their stats."""
    out = tmp_path / "r.json"
    main(["compare", "--dtype", "float32", "--model", "tiny-random-llama", "--num-requests", "6", "--clock", "sim",
          "--rate", "20",
          "--max-output-len", "16", "--max-prompt-len", "24", "--no-progress", "--num-speculative-tokens", "3",
          "--policies", "paged,spec,spec_ngram", "--json", str(out), "--figures-dir", ""]
         + (["--adaptive-k"] if adaptive else []))
    result = json.loads(out.read_text())
    assert result["config"]["draft_model"] == "tiny-random-llama"
    assert all(row["settings"]["num_speculative_tokens"] == 3 and row["settings"]["adaptive_k"] is adaptive
               for row in result["policies"].values() if "spec_decoding" in row)
    p = result["policies"]
    assert all(entry["matches_reference"] is True for entry in p.values())
    st = p["spec"]["spec_decoding"]
    assert st["num_drafts"] > 0 and st["acceptance_rate"] == 1.0  # self-speculation: every draft accepted
    assert st["mean_acceptance_length"] > 1
    assert 0 <= p["spec_ngram"]["spec_decoding"]["acceptance_rate"] <= 1
    assert "spec / paged output throughput" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens"),
    (["--draft-model", "no-such-draft"], "unknown model"),
    (["--policies", "static,fancy"], "--policies"),
    (["--num-requests", "0"], "--num-requests"),
    (["--rate", "-1"], "--rate"),
    (["--clock", "sundial"], "--clock"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--block-size", "0"], "--block-size"),
    (["--preemption-mode", "drop"], "--preemption-mode"),
    (["--reserve-new-tokens", "0", "--policies", "orca"], "--reserve-new-tokens"),
    (["--target-itl-s", "0.1", "--policies", "static,paged"], "--target-itl-s does not apply to the selected"),
    (["--batch-size", "4", "--policies", "paged"], "--batch-size does not apply to the selected policies (paged)"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--target-itl-s", "-3"], "--target-itl-s"),
    (["--queue-policy", "lifo"], "--queue-policy"),
    (["--aging-s", "0"], "--aging-s"),
    (["--long-prompts", "99"], "--long-prompts"),
    (["--long-prompt-len", "0"], "--long-prompt-len"),
    (["--trace", "/no/such/file.json"], "--trace"),
    (["--model", "no-such-model"], "unknown model"),
])
def test_bad_options_get_a_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["compare", "--dtype", "float32", "--model", "tiny-random-llama"] + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_config_validates_policy_duplicates():
    with pytest.raises(ValueError, match="twice"):
        CompareConfig(policies=("orca", "orca"))


def test_ci_runs_the_readme_test_command():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(quick) == 2 and "python -m minibatch compare" in quick[0] and "pytest --nbval" in quick[1]
    assert "grep -m1 -- '-m pytest' README.md" in (root / ".ci" / "run").read_text()


def test_a_busy_machine_is_recorded_and_named():
    """machine_load names another process that keeps a core busy; contention() turns the samples into
    the warning compare prints after a wall-clock run (and None on a quiet machine)."""
    import subprocess
    import sys

    from minibatch.report import contention, machine_load

    import os
    import signal

    import time

    # another process (its parent exits at once, so it is no child of ours) that keeps a core busy
    launcher = ("import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', 'while True: pass'], "
                "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
    other = int(subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True).stdout)
    try:
        time.sleep(0.3)
        assert other in {b["pid"] for b in machine_load(sample_s=1.0)["busy_processes"]}
    finally:
        os.kill(other, signal.SIGKILL)
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # the run's own: not counted
    try:
        time.sleep(0.3)
        assert child.pid not in {b["pid"] for b in machine_load(sample_s=0.5)["busy_processes"]}
    finally:
        child.kill()
        child.wait()
    other = {"load_average_1m": 1.0, "cpu_count": 2, "busy_processes": [{"pid": 1, "name": "hog", "cpu_percent": 97}]}
    quiet = {"load_average_1m": 1.0, "cpu_count": 2, "busy_processes": []}
    assert contention({"load_before": quiet, "load_after": quiet}) is None
    assert "other busy processes: hog (97%)" in contention({"load_before": other, "load_after": quiet})
    assert "load average 3.5 on 2 CPUs" in contention({"load_before": quiet, "load_after": quiet | {
        "load_average_1m": 3.5}})


def test_compare_records_the_load_before_and_after(tmp_path):
    main(["compare", "--model", "tiny-random-llama", "--num-requests", "3", "--max-output-len", "4", "--no-progress",
          "--policies", "orca", "--clock", "sim", "--figures-dir", "", "--json", str(tmp_path / "r.json")])
    result = json.loads((tmp_path / "r.json").read_text())
    for key in ("load_before", "load_after"):
        assert set(result["environment"][key]) == {"load_average_1m", "cpu_count", "busy_processes"}
    assert result["contended"] is None  # judged for wall-clock runs only


def test_results_name_the_commit_that_made_them():
    """environment() records the checkout's commit (git's short hash, "+changes" when tracked files differ), so a
    committed result names its code; transformers' version is read without importing it."""
    import subprocess
    import sys
    from pathlib import Path

    import minibatch
    from minibatch.report import environment, git_commit

    root = Path(minibatch.__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:  # not a checkout (an installed copy): nothing to name
        assert git_commit() is None
        return
    changes = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True).stdout.strip()
    assert git_commit() == head.stdout.strip() + ("+changes" if changes else "")
    code = "import sys; from minibatch.report import environment; e = environment(); " \
           "sys.exit(0 if e['commit'] and 'transformers' not in sys.modules else 1)"
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0
    assert environment()["commit"] == git_commit()
