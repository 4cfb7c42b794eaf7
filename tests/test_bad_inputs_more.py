"""More bad input found by probes, each refused before any work with one line naming the option and exit code 2:
bench-serve's --rate below MIN_RATE and its options that would be ignored (--burstiness with --rate inf,
--max-output-len with --output-len), calibrate's empty paths (read as "not given": a full calibration), profile's
non-ASCII or doubled-minus sizes, an unused --context-len and a --block-size past the model's context, a gpu-check in
which every selected step would be skipped, serve's blank --served-model-name; and the valid uses next to them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from minibatch.__main__ import build_parser, main
from minibatch.checks import MIN_RATE
from minibatch.experiments import step_profile
from minibatch.gpu_check import PASSED, run_gpu_check
from minibatch.serving.bench_stats import arrival_offsets, check_args

PROFILE = str(Path(__file__).resolve().parents[1] / "data/profiles/smollm2-135m-cpu.json")
BENCH = ["bench-serve", "--base-url", "http://127.0.0.1:9/v1", "--model", "m"]
PROFILE_CMD = ["profile", "--model", "tiny-random-llama"]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the cuda-only steps run")


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    # bench-serve: a rate of 1e-300 requests/s waited ~1e300 s between requests
    (BENCH + ["--rate", "1e-300"], "--rate must be in [1e-06, 1e+06]"),
    (BENCH + ["--rate", "5e-7"], "--rate must be in [1e-06"),
    (BENCH + ["--rate=-inf"], "--rate must be in"),
    # options bench-serve would ignore
    (BENCH + ["--burstiness", "0.5"], "--burstiness 0.5 does not apply with --rate inf"),
    (BENCH + ["--rate", "inf", "--burstiness", "2"], "--burstiness 2.0 does not apply with --rate inf"),
    (BENCH + ["--output-len", "5", "--max-output-len", "10"], "--max-output-len 10 does not apply with --output-len"),
    # calibrate: '' read as "not given" started a full calibration
    (["calibrate", "--refit", ""], "--refit must be a file path"),
    (["calibrate", "--refit", "  "], "--refit must be a file path"),
    (["calibrate", "--draft-only", "", "--draft-model", "tiny-random-llama"], "--draft-only must be a file path"),
    (["calibrate", "--out", ""], "--out must be a file path"),
    (["calibrate", "--refit", PROFILE, "--out", " "], "--out must be a file path"),
    # profile: int() of '--5' or '²' failed without naming the option
    (PROFILE_CMD + ["--decode-batches=--5"], "--decode-batches must be an int in [1, 65536], got '--5'"),
    (PROFILE_CMD + ["--decode-batches", "²"], "--decode-batches must be an int in [1, 65536]"),
    (PROFILE_CMD + ["--decode-batches", "1,\u0663"], "--decode-batches must be an int in [1, 65536]"),
    (PROFILE_CMD + ["--prefill-lens", "8,+-3"], "--prefill-lens must be an int in [1, 65536]"),
    (PROFILE_CMD + ["--prefill-lens", "-5"], "--prefill-lens must be an int in [1, 65536], got -5"),
    # profile: --context-len without decode steps is unused; a block past the model's context (tiny: 512)
    (PROFILE_CMD + ["--decode-batches", "", "--prefill-lens", "8", "--context-len", "60000", "--block-size", "4096"],
     "--context-len does not apply with --decode-batches empty"),
    (PROFILE_CMD + ["--decode-batches", "", "--prefill-lens", "8", "--block-size", "4096"],
     "--block-size 4096 exceeds tiny-random-llama's max_model_len 512"),
    # serve: the value given is shown as it is (the one-line error keeps runs of spaces)
    (["serve", "--model", "tiny-random-llama", "--port", "1", "--served-model-name", "  "],
     "--served-model-name must be a non-empty id (omit it for --model's), got '  '"),
    (["compare", "--model", "no  such  model"], "unknown model 'no  such  model'"),
    (["serve", "--model", "tiny-random-llama", "--port", "1", "--served-model-name", "\t"], r"got '\t'"),
])
def test_cli_bad_option_is_one_line_exit_2(argv, message, capsys, monkeypatch):
    import minibatch.roofline

    monkeypatch.setattr(minibatch.roofline, "measure_device", lambda *a: pytest.fail("timing started"))
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("minibatch ") and "Traceback" not in err


@no_gpu
@pytest.mark.parametrize("argv", [
    ["gpu-check", "--device", "cpu", "--steps", "cuda-tests"],
    ["gpu-check", "--steps", "cuda-tests"],  # the default device on a machine without a GPU: cpu
])
def test_gpu_check_of_only_skipped_steps_is_refused(argv, tmp_path, capsys):
    out = tmp_path / "x.json"
    code, err = run_cli(argv + ["--out", str(out)], capsys)
    assert code == 2 and "--steps cuda-tests: every selected step needs a GPU" in err and "nothing would run" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()  # refused before any work
    with pytest.raises(ValueError, match="every selected step needs a GPU"):
        run_gpu_check("cpu", ["cuda-tests"], out=str(out), echo=lambda line: None)


@no_gpu
def test_gpu_check_with_a_skipped_step_and_one_that_ran_still_passes(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["gpu-check", "--device", "cpu", "--steps", "environment,cuda-tests", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["passed"] and result["complete"]
    assert [s["status"] for s in result["steps"]] == [PASSED, "needs a GPU"]
    assert "gpu-check on cpu: passed" in capsys.readouterr().out


@pytest.mark.parametrize("options", [
    [],  # --rate inf with the default burstiness
    ["--rate", "inf", "--burstiness", "1.0"],  # the default given: it cannot be told apart, and it is right
    ["--rate", str(MIN_RATE), "--burstiness", "0.5", "--num-prompts", "1"],  # (more: over a week of sends)
    ["--rate", "4", "--burstiness", "3"],
    ["--output-len", "5"],  # with the default --max-output-len
    ["--max-output-len", "10"],
])
def test_bench_serve_valid_options_pass_the_checks(options):
    args = build_parser().parse_args(BENCH + options)
    assert check_args(args) is None  # no SLO given


def test_arrival_offsets_at_the_lowest_rate():
    t = arrival_offsets(3, MIN_RATE, seed=0)
    assert t[0] == 0.0 and all(math.isfinite(x) for x in t)
    with pytest.raises(ValueError, match=r"--rate must be in \[1e-06"):
        arrival_offsets(3, MIN_RATE / 2)


def test_calibrate_refit_with_out_still_refits(tmp_path, capsys):
    out = tmp_path / "refit.json"
    assert main(["calibrate", "--refit", PROFILE, "--out", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["samples"] == json.loads(Path(PROFILE).read_text())["samples"]
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize("options, shapes", [
    (["--decode-batches", "", "--prefill-lens", "8"], ((), (8,))),  # --context-len at its default: fine
    (["--decode-batches", "2", "--prefill-lens", "", "--context-len", "60"], ((2,), ())),
    (["--decode-batches", "007", "--prefill-lens", " 8 , 16 "], ((7,), (8, 16))),
])
def test_profile_valid_sizes_reach_the_profile(options, shapes, monkeypatch):
    seen = {}

    def fake_run_profile(model, device, dtype, backend, batches, prefills, *rest):
        seen["shapes"] = (batches, prefills)
        return {}

    monkeypatch.setattr(step_profile, "run_profile", fake_run_profile)
    assert main(PROFILE_CMD + options) == 0
    assert seen["shapes"] == shapes


def test_profile_block_size_up_to_the_models_context():
    step_profile.check_lengths(512, "m", (), (8,), 256, 1, block_size=512)  # a block of the whole context: fine
    with pytest.raises(ValueError, match=r"--block-size 513 exceeds m's max_model_len 512 .*; at most 512"):
        step_profile.check_lengths(512, "m", (), (8,), 256, 1, block_size=513)
