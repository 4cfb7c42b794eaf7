"""The on-disk cache of HF ``generate`` reference outputs (minibatch.reference): a hit skips ``generate`` and
returns the same ids; every key ingredient (model weights, dtype, prompt, max_new_tokens, ignore_eos) misses;
a broken cache file is recomputed, never fatal."""

import json

import pytest
import torch

from minibatch import reference
from minibatch.models import load_model
from minibatch.reference import default_cache_dir, model_fingerprint, reference_outputs
from minibatch.request import Request, SamplingParams

GREEDY = SamplingParams(ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def _model():
    return load_model("tiny-random-llama")[0]


def _requests() -> list[Request]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (4, 7, 5)]
    reqs = [Request(f"r{i}", p, n, GREEDY) for i, (p, n) in enumerate(zip(prompts, (5, 3, 6)))]
    return reqs + [Request("sampled", prompts[0], 4, SamplingParams(temperature=1.0, seed=1, ignore_eos=True))]


def _count_generate(monkeypatch, model, fail: bool = False) -> list:
    """Wrap model.generate: returns the list it appends each call's prompt length to; fail: raise instead."""
    calls, real = [], model.generate

    def generate(ids, **kwargs):
        if fail:
            raise AssertionError("generate called although the cache should serve this")
        calls.append(ids.shape[1])
        return real(ids, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    return calls


def test_second_call_is_served_from_the_cache(tmp_path, monkeypatch):
    model, reqs = _model(), _requests()
    first = reference_outputs(model, reqs, cache_dir=tmp_path)
    assert first == reference_outputs(model, reqs)  # same as without a cache
    assert set(first) == {"r0", "r1", "r2"}  # the sampled request is skipped, as without a cache
    assert len(list(tmp_path.glob("*.json"))) == 1
    _count_generate(monkeypatch, model, fail=True)
    assert reference_outputs(model, reqs, cache_dir=tmp_path) == first
    assert reference_outputs(_model(), reqs, cache_dir=tmp_path) == first  # a new model object, same weights


def test_a_longer_trace_reuses_the_cached_requests(tmp_path, monkeypatch):
    model, reqs = _model(), _requests()
    reference_outputs(model, reqs[:2], cache_dir=tmp_path)
    calls = _count_generate(monkeypatch, model)
    renamed = [Request(f"x{i}", r.prompt_token_ids, r.max_new_tokens, r.sampling) for i, r in enumerate(reqs)]
    refs = reference_outputs(model, renamed, cache_dir=tmp_path)
    assert calls == [len(reqs[2].prompt_token_ids)]  # only the new one; request ids are not part of the key
    assert refs == reference_outputs(model, renamed)


def _change_request(reqs: list[Request], what: str) -> list[Request]:
    """reqs with r0 changed in one key ingredient."""
    r = reqs[0]
    prompt, max_new, sampling = list(r.prompt_token_ids), r.max_new_tokens, r.sampling
    if what == "max_new_tokens":
        max_new += 1
    elif what == "prompt_token":
        prompt[-1] = (prompt[-1] + 1) % 512
    else:
        sampling = SamplingParams(ignore_eos=False)
    return [Request(r.request_id, prompt, max_new, sampling)] + reqs[1:]


@pytest.mark.parametrize("what", ["max_new_tokens", "prompt_token", "ignore_eos"])
def test_a_changed_request_misses(tmp_path, monkeypatch, what):
    model = _model()
    reference_outputs(model, _requests(), cache_dir=tmp_path)
    calls = _count_generate(monkeypatch, model)
    reqs = _change_request(_requests(), what)
    assert reference_outputs(model, reqs, cache_dir=tmp_path) == reference_outputs(model, reqs)
    assert len(calls) == 1 + 3  # r0 missed (the others hit), then the uncached run


def _other_weights(model):
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0  # in place, after the first fingerprint
    return model


def _seeded_model(seed: int):
    from minibatch.models import _random_config

    cls, config = _random_config("tiny-random-llama")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(config).eval()


@pytest.mark.parametrize("change", ["float64", "in_place_edit", "other_seed"])
def test_a_changed_model_misses(tmp_path, monkeypatch, change):
    model, reqs = _model(), _requests()
    first = reference_outputs(model, reqs, cache_dir=tmp_path)
    if change == "float64":
        other = model.to(torch.float64)
    elif change == "in_place_edit":
        other = _other_weights(model)
    else:
        other = _seeded_model(1)
    calls = _count_generate(monkeypatch, other)
    refs = reference_outputs(other, reqs, cache_dir=tmp_path)
    assert len(calls) == 3 and len(list(tmp_path.glob("*.json"))) == 2
    if change != "float64":
        assert refs != first


@pytest.mark.parametrize("content", [b"", b"{\"format\": 1, \"key\": ", b"\x00\xff binary", b"[1, 2]",
                                     "wrong_key", "bad_entry"])
def test_a_broken_cache_file_is_recomputed_and_rewritten(tmp_path, monkeypatch, content):
    model, reqs = _model(), _requests()
    good = reference_outputs(model, reqs, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    if content == "wrong_key":
        data["key"]["torch"] = "0.0"
    elif content == "bad_entry":
        data["outputs"][reference.request_fingerprint(model, reqs[1])] = [1, "two"]
    path.write_bytes(json.dumps(data).encode() if isinstance(content, str) else content)
    calls = _count_generate(monkeypatch, model)
    assert reference_outputs(model, reqs, cache_dir=tmp_path) == good
    assert len(calls) == (1 if content == "bad_entry" else 3)  # a bad entry alone is recomputed alone
    assert len(json.loads(path.read_text())["outputs"]) == 3  # rewritten whole


def test_an_unwritable_cache_only_warns(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    model, reqs = _model(), _requests()
    with pytest.warns(RuntimeWarning, match="reference cache not saved"):
        refs = reference_outputs(model, reqs, cache_dir=blocker / "cache")
    assert refs == reference_outputs(model, reqs)


def test_bad_cache_dir_is_one_line_error():
    with pytest.raises(ValueError, match="cache_dir must be a folder path or None"):
        reference_outputs(_model(), _requests(), cache_dir=3)


def test_model_from_files_is_fingerprinted_by_its_files_once(tmp_path, monkeypatch):
    model, tokenizer = load_model("tiny-random-llama")
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    model = load_model(str(tmp_path / "m"))[0]
    fp = model_fingerprint(model)
    assert {"model.safetensors", "config.json"} <= set(fp["files"]) and "state_dict_sha256" not in fp
    assert fp["files"]["model.safetensors"] == reference.file_sha256(tmp_path / "m" / "model.safetensors")

    def no_hashing(*args):
        raise AssertionError("hashed again")

    monkeypatch.setattr(reference, "file_sha256", no_hashing)
    monkeypatch.setattr(reference, "state_dict_sha256", no_hashing)
    assert model_fingerprint(model) == fp  # kept on the model object
    monkeypatch.undo()
    _other_weights(model)  # edited in memory: the files no longer describe it
    assert set(model_fingerprint(model)) == {"state_dict_sha256", "config_sha256"}
    assert model_fingerprint(_model())["state_dict_sha256"] != model_fingerprint(model)["state_dict_sha256"]


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path / "a"))
    assert default_cache_dir() == tmp_path / "a" / "reference"
    monkeypatch.delenv("MINIBATCH_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert default_cache_dir() == tmp_path / "h" / ".cache" / "minibatch" / "reference"
