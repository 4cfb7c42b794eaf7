"""``python -m minibatch gpu-check`` on a CPU-only machine: the CPU twins of every step pass, the
CUDA-only step says "needs a GPU", and a step that sees a wrong result fails the whole check."""

import json

import pytest
import torch

import minibatch.kernels as kernels
from minibatch.__main__ import main
from minibatch.gpu_check import FAILED, NEEDS_GPU, PASSED, STEPS, run_gpu_check
from minibatch.runner.sampler import Sampler

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU twins; on a GPU gpu-check itself runs")


def test_every_cpu_twin_passes_and_the_cuda_step_needs_a_gpu(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main(["gpu-check", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    status = {s["name"]: s["status"] for s in result["steps"]}
    assert status == {s.name: NEEDS_GPU if s.cuda_only else PASSED for s in STEPS}
    assert result["passed"] and result["device"] == "cpu"
    assert result["command"].startswith("python -m minibatch gpu-check")
    steps = {s["name"]: s["details"] for s in result["steps"]}
    assert steps["environment"]["torch"] == torch.__version__ and steps["environment"]["triton_interpreted"]
    assert steps["kernels"]["compiled"] is False
    assert all(all(v.values()) for k, v in steps["greedy-fp32"].items() if isinstance(v, dict))
    bench = steps["benchmark"]
    assert set(bench["output_throughput_tok_s"]) == {"static", "orca", "paged", "chunked", "spec_ngram",
                                                      "hf_generate", "hf_generate_batch"}
    assert bench["best_vs_hf_generate"] > 0
    assert [(r["kind"], r["batch"]) for r in steps["profile"]["shapes"]] == [("decode", 1), ("decode", 32),
                                                                            ("prefill", 1)]
    assert {"sdpa", "compiled"} <= {k.split("/")[1] for k in steps["greedy-fp32"] if "/" in k}
    printed = capsys.readouterr().out
    assert "NEEDS A GPU  cuda-tests" in printed and "gpu-check on cpu: passed" in printed


def test_a_wrong_kernel_fails_the_check(tmp_path, monkeypatch):
    real = kernels.paged_decode_attention
    monkeypatch.setattr(kernels, "paged_decode_attention", lambda *a, **k: real(*a, **k) + 1e-2)
    result = run_gpu_check("cpu", ["kernels"], out=str(tmp_path / "c.json"), echo=lambda line: None)
    (step,) = result["steps"]
    assert step["status"] == FAILED and not result["passed"]
    assert "decode float32_block5: max abs error" in step["details"]["error"]
    assert json.loads((tmp_path / "c.json").read_text())["passed"] is False


def test_wrong_tokens_fail_the_greedy_step_and_the_command_exits_1(tmp_path, monkeypatch):
    real = Sampler.sample_batch

    def off_by_one(self, request_ids, logits, params):  # every token one id too high
        return {rid: (t + 1) % logits.shape[-1] for rid, t in real(self, request_ids, logits, params).items()}

    monkeypatch.setattr(Sampler, "sample_batch", off_by_one)
    with pytest.raises(SystemExit) as exit_:
        main(["gpu-check", "--steps", "greedy-fp32,main-job", "--out", str(tmp_path / "c.json")])
    assert exit_.value.code == 1
    result = json.loads((tmp_path / "c.json").read_text())
    assert [s["status"] for s in result["steps"]] == [FAILED, FAILED]
    assert "outputs differ from HF generate" in result["steps"][0]["details"]["error"]


def test_a_crashing_step_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "store_kv", lambda *a, **k: 1 / 0)
    result = run_gpu_check("cpu", ["environment", "kernels"], out=str(tmp_path / "c.json"), echo=lambda line: None)
    assert [s["status"] for s in result["steps"]] == [PASSED, FAILED]
    assert "ZeroDivisionError" in result["steps"][1]["details"]["error"]
    assert "traceback" in result["steps"][1]["details"]


def test_a_check_killed_mid_way_keeps_the_steps_already_done_and_the_earlier_result(tmp_path, monkeypatch):
    """A lease can end mid-check: the steps done are written after each one, to c.partial.json, marked incomplete
    and not passed; c.json (an earlier whole check, e.g. the committed one) is left as it was until all have run."""
    def lease_over(*a, **k):
        raise KeyboardInterrupt  # not an Exception: nothing records it, as when the process is killed

    out, partial = tmp_path / "c.json", tmp_path / "c.partial.json"
    out.write_text('{"earlier": true}')
    monkeypatch.setattr(kernels, "store_kv", lease_over)
    with pytest.raises(KeyboardInterrupt):
        run_gpu_check("cpu", ["environment", "kernels"], out=str(out), echo=lambda line: None)
    assert json.loads(out.read_text()) == {"earlier": True}
    result = json.loads(partial.read_text())
    assert [s["name"] for s in result["steps"]] == ["environment"] and result["complete"] is result["passed"] is False
    monkeypatch.undo()
    assert run_gpu_check("cpu", ["environment"], out=str(out), echo=lambda line: None)["complete"] is True
    assert json.loads(out.read_text())["passed"] is True and not partial.exists()


def test_a_subset_of_the_steps_has_its_own_default_file():
    from minibatch.gpu_check import default_out

    assert default_out("cpu") == "data/gpu/gpu_check_cpu.json"
    assert default_out("cpu", ["environment", "kernels"]) == "data/gpu/gpu_check_cpu.environment-kernels.json"


@pytest.mark.parametrize("argv, message", [
    (["gpu-check", "--steps", "kernels,warp-drive"], "--steps must be a comma-separated subset"),
    (["gpu-check", "--device", "cuda:3"], "--device"),
    (["gpu-check", "--bench-requests", "0"], "--bench-requests"),
])
def test_bad_options_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
