"""HF's side of every comparison does only what our engine does: nothing of the checkpoint's generation_config.

A checkpoint's generation_config.json (repetition_penalty, no_repeat_ngram_size, suppress_tokens, sampling
defaults, ...) is what ``model.generate`` applies by default; the engine implements none of it. The reference
(``compare.reference_outputs``) and the HF baselines must leave it out, or ``matches_reference`` is false for a
correct engine and the baselines do different work.
"""

import importlib.util

import pytest
import torch

from minibatch import ModelRunner, Request, SamplingParams
from minibatch.baselines import (plain_generation, plain_generation_config, run_hf_generate,
                                 run_hf_generate_batch)
from minibatch.compare import CompareConfig, run_compare
from minibatch.experiment import all_policies
from minibatch.reference import reference_outputs
from minibatch.models import attention_implementation, load_model
from minibatch.policies import make_engine
from minibatch.runner.sampler import filter_logits
from minibatch.clock import SimClock

MAX_NEW = 10


def _prompts(vocab_size: int, n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab_size, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def _engine_outputs(model, tok, reqs: list[Request]) -> dict[str, list[int]]:
    out = make_engine("orca", ModelRunner(model, tok), SimClock()).generate([r.copy() for r in reqs])
    return {r.request_id: r.output_token_ids for r in out}


@pytest.fixture(scope="module")
def quirky(one_thread):
    """(model, tokenizer, requests, the engine's outputs): tiny-random-llama whose generation_config sets
    every kind of thing generate() would apply, aimed at tokens the greedy outputs really contain.

    The EOS id is the third token of request e0's plain output, so e0 (no ignore_eos) stops there unless
    min_new_tokens or a suppression keeps HF from emitting it; the i* requests ignore EOS."""
    model, tok = load_model("tiny-random-llama")
    prompts = _prompts(model.config.vocab_size)
    plain = _engine_outputs(model, tok, [Request("x", prompts[0], MAX_NEW, SamplingParams(ignore_eos=True))])["x"]
    seen = sorted({t for p in prompts for t in p})
    model.generation_config.update(
        eos_token_id=plain[2], do_sample=True, temperature=0.7, top_k=5, top_p=0.9, typical_p=0.9, min_p=0.05,
        repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=8, min_length=12,
        suppress_tokens=[plain[0], plain[3]], begin_suppress_tokens=[plain[1]], bad_words_ids=[[plain[4]]],
        sequence_bias={(seen[0],): 5.0}, forced_eos_token_id=seen[1], exponential_decay_length_penalty=(2, 1.5),
        renormalize_logits=True, remove_invalid_values=True, num_beams=2, length_penalty=2.0)
    reqs = [Request("e0", prompts[0], MAX_NEW)] + [
        Request(f"i{i}", p, MAX_NEW, SamplingParams(ignore_eos=True)) for i, p in enumerate(prompts[1:], 1)]
    outputs = _engine_outputs(model, tok, reqs)
    assert outputs["e0"] == plain[:3]  # the engine stops at the chosen EOS
    return model, tok, reqs, outputs


def test_the_checkpoint_config_would_change_the_tokens(quirky):
    """The negative control: greedy ``generate`` given only our fields as keywords (what the reference
    did before) inherits the rest of the config: other tokens, or no run at all (HF's
    exponential_decay_length_penalty fails without an EOS id)."""
    model, _, reqs, outputs = quirky
    changed = 0
    for r in reqs:
        ids = torch.tensor([r.prompt_token_ids])
        try:
            with attention_implementation(model, "sdpa"), torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_new_tokens,
                                     do_sample=False, eos_token_id=None if r.sampling.ignore_eos else [2])
            changed += out[0, ids.shape[1]:].tolist() != outputs[r.request_id]
        except RuntimeError:
            changed += r.sampling.ignore_eos
    assert changed == len(reqs)


def test_reference_equals_the_engine(quirky):
    model, _, reqs, outputs = quirky
    saved = model.generation_config.to_dict()
    assert reference_outputs(model, reqs) == outputs
    assert model.generation_config.to_dict() == saved  # restored


@pytest.mark.parametrize("name", ["hf_generate", "hf_generate_batch"])
def test_hf_baselines_equal_the_engine(quirky, name, capfd):
    model, _, reqs, outputs = quirky
    run = {"hf_generate": lambda rs: run_hf_generate(model, rs, batch_size=3, max_wait_s=0.0),
           "hf_generate_batch": lambda rs: run_hf_generate_batch(model, rs)}[name]
    got = run([r.copy() for r in reqs])
    assert {r.request_id: r.output_token_ids for r in got} == outputs
    assert got[0].finish_reason == "stop"
    assert model.generation_config.num_beams == 2  # the model's own config is back


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=1.0, seed=0),
                                      SamplingParams(temperature=0.5, top_k=7, seed=0)])
def test_generate_applies_only_our_sampling(quirky, sampling):
    """Under ``plain_generation`` every step's processed scores are the raw logits with exactly our
    filters applied (greedy: none), whatever the checkpoint's config says."""
    model, _, reqs, _ = quirky
    ids = torch.tensor([reqs[1].prompt_token_ids])
    cfg = plain_generation_config(model, 6, sampling, output_scores=True, output_logits=True,
                                  return_dict_in_generate=True)
    with attention_implementation(model, "sdpa"), plain_generation(model, cfg), torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    assert len(out.scores) == 6
    for scores, logits in zip(out.scores, out.logits):
        expected = logits[0] if sampling is None else filter_logits(logits[0], sampling)
        assert torch.equal(scores[0], expected)


def test_plain_generation_config_fields():
    model, _ = load_model("tiny-random-llama")
    model.generation_config.update(repetition_penalty=1.3, suppress_tokens=[5], temperature=0.3, do_sample=True)
    cfg = plain_generation_config(model, 7, SamplingParams(temperature=0.8, top_k=4, top_p=0.5))
    assert (cfg.max_new_tokens, cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p) == (7, True, 0.8, 4, 0.5)
    assert cfg.eos_token_id == [2] and cfg.pad_token_id == 0
    assert cfg.repetition_penalty == 1.0 and cfg.no_repeat_ngram_size == 0 and cfg.suppress_tokens is None
    greedy = plain_generation_config(model, 3, SamplingParams(ignore_eos=True))
    assert greedy.do_sample is False and greedy.eos_token_id is None
    assert plain_generation_config(model, 3, eos_token_id=-1).eos_token_id == -1
    with pytest.raises(TypeError, match="not_a_field"):
        plain_generation_config(model, 3, not_a_field=1)
    saved = model.generation_config
    with pytest.raises(RuntimeError):
        with plain_generation(model, cfg):
            assert model.generation_config is cfg
            raise RuntimeError("boom")
    assert model.generation_config is saved  # restored on error too


def test_run_compare_matches_reference_for_every_policy(quirky, tmp_path):
    """A checkpoint directory with such a generation_config.json: every policy, ours and HF's, matches."""
    model, tok, _, _ = quirky
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    result = run_compare(CompareConfig(model=str(tmp_path), dtype="float32", num_requests=4, arrival="zero",
                         clock="sim",
                                       max_prompt_len=16, max_output_len=10, policies=all_policies(),
                                       figures_dir=None, progress=False))
    # vLLM is a peer only where it is installed (compare skips its row otherwise, saying so)
    expected = [p for p in all_policies() if p != "vllm" or importlib.util.find_spec("vllm") is not None]
    assert {p: e["matches_reference"] for p, e in result["policies"].items()} == {p: True for p in expected}
