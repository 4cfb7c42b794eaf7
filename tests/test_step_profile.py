"""The step profile (``python -m minibatch profile``, minibatch/experiments/step_profile.py): every shape's
components add up to its profiled step, the roofline counts are the hand-computed ones, bad options are one line."""

import importlib.util
import json

import sys

import pytest

from benchmark_scripts import load_benchmark
from minibatch.__main__ import main
from minibatch.experiments.step_components import COMPONENTS, component_of_module
from minibatch.experiments.step_profile import step_counts
from minibatch.models import load_model
from minibatch.runner import ModelRunner


def test_profile_command_writes_components_roofline_and_figure(tmp_path, one_thread):
    out, fig = tmp_path / "profile.json", tmp_path / "profile.png"
    main(["profile", "--model", "tiny-random-llama", "--dtype", "float32", "--attention-backend", "sdpa",
          "--decode-batches", "1,4", "--prefill-lens", "24", "--context-len", "20", "--repeats", "2",
          "--block-size", "8", "--json", str(out), "--figure", str(fig)])
    result = json.loads(out.read_text())
    assert result["block_size"] == 8
    assert [(r["kind"], r["batch"], r["tokens"]) for r in result["shapes"]] == [
        ("decode", 1, 1), ("decode", 4, 4), ("prefill", 1, 24)]
    for r in result["shapes"]:
        parts = r["components_s"]
        assert set(parts) == set(COMPONENTS) and min(parts.values()) >= 0
        assert sum(parts.values()) == pytest.approx(r["profiled_step_s"], rel=0.05)  # nothing lost, nothing twice
        assert parts["qkv_proj"] > 0 and parts["attention"] > 0 and parts["mlp"] > 0 and parts["sampling"] > 0
        assert parts["schedule"] > 0  # the scheduler's own Python (it runs no torch ops)
        assert 0 < r["overhead_share"] < 1 and r["bound_s"] > 0 and r["step_over_bound"] == pytest.approx(
            r["step_s"] / r["bound_s"], rel=0.01)
        paired = r["paired"]  # on a CPU: steps paired with the peak and the bandwidth measured just before them
        peaks, bws = paired["peak_flop_per_s"], paired["bytes_per_s"]
        assert len(paired["step_s"]) == len(peaks) == len(bws) == 2 and min(peaks) > 0 and min(bws) > 0
        bounds = [max(r["flops"] / f, r["bytes"] / b) for f, b in zip(peaks, bws)]  # each moment's own roofs
        assert r["step_over_bound_during_steps"] == pytest.approx(
            sum(s / b for s, b in zip(paired["step_s"], bounds)) / 2, abs=0.006)  # the median of two, rounded
        assert r["bytes_per_s_during_steps"] == pytest.approx(sum(bws) / 2)
        assert r["peak_flop_per_s_during_steps"] == pytest.approx(sum(peaks) / 2)
        roof = result["roofline"]  # the same roofs: no probe saw more than the roofs the bounds use
        assert roof["peak_flop_per_s"] >= max(peaks) and roof["bytes_per_s"] >= max(bws)
    assert result["roofline"]["peak_flop_per_s"] > 0 and fig.stat().st_size > 0 and result["command"].startswith(
        "python -m minibatch profile")


def test_roofline_counts_by_hand():
    model, tok = load_model("tiny-random-llama", dtype="float32")
    cfg = model.config
    runner = ModelRunner(model, tok)
    params = sum(p.numel() for p in model.parameters())
    vocab_rows = cfg.vocab_size * cfg.hidden_size
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    body = params - vocab_rows * (1 if tied else 2)
    flops, nbytes = step_counts(model, num_logits=2, tokens=3, attended=[5, 6, 7], kv_read_tokens=10,
                                kv_bytes_per_token=runner.kv_bytes_per_token)
    assert flops == 2 * body * 3 + 2 * vocab_rows * 2 + 4 * cfg.hidden_size * cfg.num_hidden_layers * 18
    assert nbytes == params * 4 + (10 + 3) * runner.kv_bytes_per_token


def test_module_names_map_to_components():
    assert component_of_module("model.layers.3.self_attn.q_proj") == "qkv_proj"
    assert component_of_module("model.layers.3.post_attention_layernorm") == "norms"
    assert component_of_module("model.layers.3.mlp") == "mlp" and component_of_module("lm_head") == "logits"
    assert component_of_module("model.layers.3.mlp.act_fn") is None


@pytest.mark.parametrize("option,value", [("--decode-batches", "0"), ("--prefill-lens", "x"), ("--repeats", "0"),
                                          ("--block-size", "0"), ("--block-size", "100000"), ("--rounds", "0"),
                                          ("--rounds", "21"), ("--threads", "0"), ("--threads", "-1"),
                                          ("--vllm-python", "/no/such/python"), ("--vllm-python", sys.executable),
                                          ("--figure", "breakdown.txt")])
def test_bad_profile_options_are_one_line(option, value, capsys):
    """(--vllm-python without vllm, and a --figure saved elsewhere as NAME.png, failed only after the profile.)"""
    if value == sys.executable and importlib.util.find_spec("vllm") is not None:
        pytest.skip("this Python has vllm")
    with pytest.raises(SystemExit) as e:
        main(["profile", "--model", "tiny-random-llama", option, value])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and option in err


@pytest.mark.parametrize("options,option", [(["--prefill-lens", "600"], "--prefill-lens 600"),
                                            (["--prefill-lens", "", "--context-len", "500"], "--context-len 500"),
                                            (["--prefill-lens", "", "--context-len", "491", "--repeats", "6"],
                                             "--context-len 491")])
def test_profile_lengths_past_the_models_context_are_one_line(options, option, capsys):
    """tiny-random-llama's max_model_len is 512; each profiled request generates 3 x --repeats + 6 tokens."""
    with pytest.raises(SystemExit) as e:
        main(["profile", "--model", "tiny-random-llama", "--decode-batches", "1", *options])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and option in err and "max_model_len 512" in err


def test_07b_regime_prediction(capsys):
    from minibatch.files import read_json
    from minibatch.lessons.step_time import check_regime, profile_rows

    profile = read_json("data/cpu/step_profile.json")
    bound = next(r["bound"] for r in profile_rows(profile) if r["shape"] == "decode 1")
    other = {"memory": "compute", "compute": "memory"}[bound]
    assert check_regime(bound, profile) is True and check_regime(other, profile) is False
    assert check_regime(..., profile) is False  # the student edition's stub
    printed = capsys.readouterr().out
    assert printed.count("correct:") == 1 and "not implemented yet" in printed and bound + "-bound" in printed


def test_median_round_keeps_one_rounds_components():
    from minibatch.experiments.step_profile import median_round

    rounds = [{"step_s": s, "components_s": {"mlp": s}, "paired": {"step_s": [s]}} for s in (3.0, 1.0, 2.0)]
    row = median_round(rounds)
    assert row["step_s"] == 2.0 and row["components_s"] == {"mlp": 2.0} and row["round_step_s"] == [3.0, 1.0, 2.0]
    assert row["paired"] == {"step_s": [3.0, 1.0, 2.0]}  # every round's probes
    assert median_round(rounds[:2])["step_s"] == 1.0  # an even count: the lower of the two middle rounds
    assert rounds[0]["paired"] == {"step_s": [3.0]}  # the rounds' own rows are left as they were


def test_decode_step_runs_one_profile_process(tmp_path):
    """benchmarks/decode_step_runs.py: a run is a profile in its own process, reduced to its step, bound and roofs."""
    out = tmp_path / "runs.json"
    result = load_benchmark("decode_step_runs").main(["--model", "tiny-random-llama", "--dtype", "float32",
                                                      "--attention-backend", "sdpa", "--runs", "1", "--batch", "2",
                                                      "--context-len", "16", "--repeats", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == result and len(result["runs"]) == 1
    run = result["runs"][0]
    assert run["step_over_bound"] == pytest.approx(run["step_ms"] / run["bound_ms"], rel=0.02)
    assert len(run["paired_steps_ms"]) == 2 and run["load_average_1m_before"] >= 0
    assert result["summary"]["step_over_bound_median"] == run["step_over_bound"]


def test_decode_step_runs_a_failed_run_is_one_error():
    """A profile that fails in its process (here an unknown model, which only the profile checks) ends the set with
    a ValueError naming the run (one line at the command line), not a CalledProcessError's traceback."""
    with pytest.raises(ValueError, match=r"^run 1/2: the profile exited with 2: -m minibatch profile --model nope"):
        load_benchmark("decode_step_runs").main(["--model", "nope", "--runs", "2"])


def test_decode_step_runs_summary_is_the_runs_own():
    """The set's medians and within-2x counts, by hand: ratios 1.8, 2.0, 2.3 (median 2.0, two within 2x)."""
    keys = ("step_ms", "bound_ms", "peak_gflop_per_s", "peak_gflop_per_s_during_steps", "bytes_gb_per_s",
            "bytes_gb_per_s_during_steps")
    runs = [dict(dict.fromkeys(keys, float(i)), step_over_bound=ratio, step_over_bound_during_steps=ratio - 0.1)
            for i, ratio in enumerate((2.3, 1.8, 2.0))]
    s = load_benchmark("decode_step_runs").summary(runs)
    assert (s["runs"], s["step_over_bound_min"], s["step_over_bound_median"], s["step_over_bound_max"]) == (
        3, 1.8, 2.0, 2.3)
    assert (s["within_2x"], s["within_2x_during_steps"], s["step_over_bound_during_steps_median"]) == (2, 2, 1.9)
    assert s["step_ms_median"] == 1.0
