"""Reduced precision: --dtype resolution, the KV cache in the model's dtype, engine logprobs equal HF's,
and the two equivalence rules -- exact in fp32, logprob-close in bf16 -- including a deliberately broken
engine that the close rule must catch. Every test pins its dtype: results never depend on this CPU."""

import dataclasses
import json

import pytest
import torch

from minibatch import ModelRunner, Request, SamplingParams, SimClock
from minibatch.__main__ import main
from minibatch.equivalence import (MATCH_WINDOW, MAX_LOGPROB_GAP, MIN_MATCHED_FRACTION, ReferenceOutput,
                                   check_outputs, first_divergence, rule_for)
from minibatch.experiment import run
from minibatch.models import load_model
from minibatch.precision import DTYPES, resolve_dtype
from minibatch.reference import reference_outputs

MODEL = "tiny-random-llama"


def test_resolve_dtype(monkeypatch):
    assert [resolve_dtype(n) for n in DTYPES[:3]] == [torch.float32, torch.bfloat16, torch.float16]
    assert resolve_dtype(torch.float16) is torch.float16
    monkeypatch.setattr("minibatch.precision.cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr("minibatch.precision.cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") is torch.float32
    with pytest.raises(ValueError, match="--dtype must be one of float32, bfloat16, float16, auto, got 'half'"):
        resolve_dtype("half")


def test_bf16_model_kv_cache_and_bytes_per_token():
    fp32 = ModelRunner(*load_model(MODEL, dtype="float32"))
    bf16 = ModelRunner(*load_model(MODEL, dtype="bfloat16"))
    assert bf16.model.dtype == torch.bfloat16 and bf16.kv_bytes_per_token * 2 == fp32.kv_bytes_per_token
    bf16.allocate_kv_cache(num_blocks=4, block_size=4)
    assert bf16.kv_cache.dtype == torch.bfloat16


def requests(n=4, max_new_tokens=12, logprobs=None):
    return [Request(f"r{i}", [5 + 7 * i + j for j in range(3 + 4 * i)], max_new_tokens,
                    SamplingParams(ignore_eos=True, logprobs=logprobs), arrival_time_s=0.01 * i) for i in range(n)]


@pytest.mark.parametrize("policy", ["static", "paged", "spec_ngram"])
def test_engine_logprobs_equal_hf_generate(one_thread, policy):
    model, tok = load_model(MODEL, dtype="float32")
    reqs = requests(logprobs=3)
    refs = reference_outputs(model, reqs, logprobs=3)
    result = run(policy, reqs, ModelRunner(model, tok), SimClock(), config=dict(n_slots=256, block_size=4))
    for r in result.requests:
        ref = refs[r.request_id]
        assert r.output_token_ids == ref.token_ids and len(r.logprobs) == len(r.output_token_ids)
        for ours, theirs, t in zip(r.logprobs, ref.logprobs, r.output_token_ids):
            assert set(ours) == set(theirs) and len(ours) == 3 and max(ours, key=ours.get) == t
            assert all(abs(ours[k] - theirs[k]) < 1e-4 for k in ours)


def ref(token_ids, logprobs):
    return ReferenceOutput(token_ids, [dict(p) for p in logprobs])


def finished(rid, tokens, logprobs=()):
    r = Request(rid, [1, 2], len(tokens))
    r.output_token_ids, r.logprobs = list(tokens), [dict(p) for p in logprobs]
    return r


def test_exact_rule_reports_the_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    report = check_outputs([finished("a", [1, 2, 3]), finished("b", [1, 9, 3])], {"a": [1, 2, 3], "b": [1, 2, 3]})
    assert report["rule"] == "exact" and report["passed"] is False
    assert report["divergences"] == {"b": {"position": 1, "token": 9, "reference_token": 2}}
    assert check_outputs([finished("a", [1, 2, 3])], {"a": [1, 2, 3]})["passed"] is True
    assert check_outputs([finished("a", [1])], {})["passed"] is None
    assert rule_for(torch.float32) == "exact" and rule_for(torch.bfloat16) == "logprob-close"


def test_logprob_close_rule_by_hand():
    n = MATCH_WINDOW
    tied = {7: -0.6, 8: -0.6 - MAX_LOGPROB_GAP / 2}  # the reference prefers 7 over 8 by less than the threshold
    sure = {7: -0.01, 8: -6.0}
    tokens = [3] * (n - 1)
    lps = [{3: -0.1}] * (n - 1)
    ours_tied = {8: -0.6, 7: -0.65}

    def check(ref_lp, our_lp, ours=8, refs_token=7):
        out = finished("a", tokens + [ours], lps + [our_lp])
        return check_outputs([out], {"a": ref(tokens + [refs_token], lps + [ref_lp])}, "logprob-close")

    close = check(tied, ours_tied)
    assert close["passed"] is True and close["divergences"]["a"]["close"] is True
    assert close["divergences"]["a"]["reference_gap"] == pytest.approx(MAX_LOGPROB_GAP / 2)
    assert check(sure, ours_tied)["passed"] is False  # the reference was confident: a real error
    assert check(tied, {8: -0.01})["passed"] is False  # the reference's token is not in our top-k
    assert check({7: -0.6}, ours_tied)["passed"] is False  # ours is not in the reference's top-k
    # a near-tie flip at the first token leaves too little matched: the floor fails the trace
    early = check_outputs([finished("a", [8] + tokens, [ours_tied] + lps)], {"a": ref([7] + tokens, [tied] + lps)},
                          "logprob-close")
    assert early["divergences"]["a"]["close"] is True and early["matched_fraction"] < MIN_MATCHED_FRACTION
    assert early["passed"] is False


def test_an_exact_tie_is_not_a_mismatch():
    """At an exact tie (reference gap 0.0) the request counts as matched through its window; one bf16 step
    (0.03125) is a near-tie, close but counted against the floor; a confident divergence still fails."""
    tokens, lps = [3] * (MATCH_WINDOW - 1), [{3: -0.1}] * (MATCH_WINDOW - 1)
    ours = {8: -0.69, 7: -0.69}

    def at_first_token(ref_lp):
        return check_outputs([finished("a", [8] + tokens, [ours] + lps)], {"a": ref([7] + tokens, [ref_lp] + lps)},
                             "logprob-close")

    tie = at_first_token({7: -0.69, 8: -0.69})
    assert tie["passed"] is True and tie["matched_fraction"] == 1.0 and tie["divergences"]["a"]["exact_tie"] is True
    step = at_first_token({7: -0.69, 8: -0.69 - 0.03125})
    assert step["divergences"]["a"]["close"] is True and step["divergences"]["a"]["exact_tie"] is False
    assert step["passed"] is False  # an early near-tie leaves too little matched
    assert at_first_token({7: -0.01, 8: -6.0})["passed"] is False


def test_tiny_models_pass_at_exact_ties_and_a_broken_engine_still_fails(tmp_path, one_thread):
    """The command that failed a correct engine on exact ties passes; DropsFirstBlock on its trace fails."""
    from minibatch.compare import CompareConfig, build_trace
    from minibatch.equivalence import with_logprobs

    argv = ["--model", MODEL, "--clock", "sim", "--num-requests", "6", "--policies", "static,orca,paged",
            "--dtype", "bfloat16"]
    main(["compare", *argv, "--no-progress", "--figures-dir", "", "--reference-cache", "",
          "--json", str(tmp_path / "r.json")])
    rows = json.loads((tmp_path / "r.json").read_text())["policies"]
    assert {p: r["matches_reference"] for p, r in rows.items()} == {"static": True, "orca": True, "paged": True}
    assert any(d["exact_tie"] for d in rows["paged"]["reference_check"]["divergences"].values())
    model, tok = load_model(MODEL, dtype="bfloat16")
    cfg = CompareConfig(model=MODEL, num_requests=6, dtype="bfloat16", check_reference=False, figures_dir=None)
    reqs = [with_logprobs(r, 5) for r in build_trace(cfg, tok, model.config.vocab_size)]
    refs = reference_outputs(model, reqs, logprobs=5)
    bad = run("paged", reqs, DropsFirstBlock(model, tok), SimClock(), n_slots=4096, block_size=4)
    assert check_outputs(bad.requests, refs, "logprob-close")["passed"] is False


class DropsFirstBlock(ModelRunner):
    """A broken engine: every decode step loses the first KV block of each request (zeroed)."""

    def execute(self, out):
        for s in out.scheduled:
            if not s.request.is_prefill and self.kv_cache is not None:
                self.kv_cache[:, :, out.block_tables[s.request_id][0]] = 0
        return super().execute(out)


def test_bf16_engine_is_close_and_a_broken_one_is_caught(one_thread):
    model, tok = load_model(MODEL, dtype="bfloat16")
    reqs = requests(n=4, max_new_tokens=16, logprobs=5)
    refs = reference_outputs(model, reqs, logprobs=5)
    config = dict(n_slots=256, block_size=4)
    good = run("paged", reqs, ModelRunner(model, tok), SimClock(), config=config)
    report = check_outputs(good.requests, refs, "logprob-close")
    assert report["passed"] is True, report
    bad = run("paged", reqs, DropsFirstBlock(model, tok), SimClock(), config=config)
    report = check_outputs(bad.requests, refs, "logprob-close")
    assert report["passed"] is False and report["matched_fraction"] < MIN_MATCHED_FRACTION
    assert check_outputs(bad.requests, {k: v.token_ids for k, v in refs.items()})["passed"] is False


def test_compare_in_bf16_records_the_rule(tmp_path, one_thread):
    out = tmp_path / "r.json"
    main(["compare", "--dtype", "bfloat16", "--model", MODEL, "--num-requests", "4", "--rate", "50",
          "--max-output-len", "8", "--max-prompt-len", "16", "--policies", "paged,hf_generate", "--clock", "sim",
          "--no-progress", "--figures-dir", "", "--reference-cache", "", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["config"]["dtype"] == "bfloat16"
    for policy, row in result["policies"].items():
        check = row["reference_check"]
        assert check["rule"] == "logprob-close" and check["passed"] is True and row["matches_reference"] is True
        assert set(check) >= {"top_k", "max_logprob_gap", "min_matched_fraction", "matched_fraction", "divergences"}


def test_kv_budget_in_bytes_follows_the_dtype(tmp_path, one_thread):
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"{dtype}.json"
        main(["compare", "--dtype", dtype, "--model", MODEL, "--num-requests", "2", "--max-output-len", "4",
              "--max-prompt-len", "8", "--policies", "paged", "--clock", "sim", "--no-reference", "--no-progress",
              "--figures-dir", "", "--kv-cache-memory-bytes", str(1 << 20), "--json", str(out)])
        sizes[dtype] = json.loads(out.read_text())["config"]["n_slots"]
    # fp32: K and V x 2 layers x 2 KV heads x head_dim 16 x 4 bytes = 512 bytes per token
    assert sizes["bfloat16"] == 2 * sizes["float32"] == 2 * (1 << 20) // 512


def test_logprobs_field_is_checked():
    with pytest.raises(ValueError, match=r"logprobs must be an int in \[0, 20\]"):
        SamplingParams(logprobs=21)
    assert dataclasses.replace(SamplingParams(), logprobs=0).logprobs == 0


def test_a_profile_of_another_dtype_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["compare", "--dtype", "bfloat16", "--model", MODEL, "--clock", "sim", "--no-reference",
              "--profile", "data/profiles/smollm2-135m-cpu.json", "--figures-dir", "", "--no-progress"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "loaded in" not in out  # before it loads
    assert "was calibrated in float32, the model runs in bfloat16: pass --dtype float32" in err
