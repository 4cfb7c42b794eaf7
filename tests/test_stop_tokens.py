"""vLLM's ``stop_token_ids`` and ``min_tokens`` (SamplingParams): a stop token id finishes a request like EOS
(kept in the output, finish_reason "stop"); before ``min_tokens`` output tokens, EOS and the stop ids cannot be
sampled. Checked token for token against HF ``generate`` with the same ids as its eos_token_id and
``min_new_tokens`` (its MinNewTokensLengthLogitsProcessor bans them the same way), under every non-speculative
policy; refused under speculative ones; bad values refused naming the field."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch.clock import SimClock
from minibatch.models import load_model, set_attention
from minibatch.policies import make_engine
from minibatch.reference import reference_outputs
from minibatch.request import Request, SamplingParams
from minibatch.runner import ModelRunner

PROMPTS = [[5 + 3 * i + j for j in range(4 + 3 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def tiny(one_thread):
    model, tokenizer = load_model("tiny-random-llama")
    return model, ModelRunner(model, tokenizer)


def hf_generate(model, prompt, max_new_tokens, stop_ids, min_new_tokens):
    set_attention(model, "sdpa")  # the runner switched the model to its packed attention
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=list(stop_ids), pad_token_id=0,
                             min_new_tokens=min_new_tokens)
    tokens = out[0, len(prompt):].tolist()
    for i, t in enumerate(tokens):  # generate pads after a finished row: cut at the first stop
        if t in stop_ids and i >= min_new_tokens:
            return tokens[: i + 1]
    return tokens


@pytest.mark.parametrize("policy", ["static", "orca", "paged", "chunked"])
@pytest.mark.parametrize("min_tokens", [0, 6])
def test_stop_token_ids_and_min_tokens_match_hf_generate(tiny, policy, min_tokens):
    model, runner = tiny
    free = reference_outputs(model, [Request(f"f{i}", p, 12, SamplingParams(ignore_eos=True))
                                     for i, p in enumerate(PROMPTS)])
    # each request stops at a token its free-running greedy output holds early (index 2): without min_tokens it
    # stops there; with min_tokens 6 that token is banned at indices 0..5 and the output changes
    stops = [(free[f"f{i}"][2],) for i in range(len(PROMPTS))]
    reqs = [Request(f"r{i}", p, 12, SamplingParams(ignore_eos=True, stop_token_ids=stops[i], min_tokens=min_tokens),
                    arrival_time_s=0.01 * i) for i, p in enumerate(PROMPTS)]
    shared = dict(max_num_seqs=4, n_slots=256, block_size=4, batch_size=4)  # each policy takes its own
    make_engine(policy, runner, SimClock(), config=shared).generate(reqs)
    for r, stop in zip(reqs, stops):
        expected = hf_generate(model, r.prompt_token_ids, 12, stop, min_tokens)
        assert r.output_token_ids == expected
        assert all(t not in stop for t in r.output_token_ids[:min_tokens])
        assert r.finish_reason == ("stop" if r.output_token_ids[-1] in stop else "length")
    assert min_tokens or all(r.finish_reason == "stop" and r.num_output_tokens <= 3 for r in reqs)


def test_min_tokens_bans_eos_too(tiny):
    """Without ignore_eos the model's EOS is banned before min_tokens as well (here made the greedy choice)."""
    model, runner = tiny
    free = reference_outputs(model, [Request("f", PROMPTS[1], 8, SamplingParams(ignore_eos=True))])["f"]
    saved, runner.eos_token_ids = runner.eos_token_ids, (free[0],)  # the first greedy token is "EOS"
    try:
        plain = Request("a", PROMPTS[1], 8)
        banned = Request("b", PROMPTS[1], 8, SamplingParams(min_tokens=4))
        make_engine("paged", runner, SimClock(), max_num_seqs=2, n_slots=256).generate([plain, banned])
    finally:
        runner.eos_token_ids = saved
    assert plain.output_token_ids == [free[0]] and plain.finish_reason == "stop"
    assert free[0] not in banned.output_token_ids[:4] and banned.num_output_tokens >= 4


def test_speculative_policies_refuse_min_tokens(tiny):
    _, runner = tiny
    engine = make_engine("spec_ngram", runner, SimClock(), max_num_seqs=2, n_slots=256)
    with pytest.raises(ValueError, match="min_tokens is not supported .*speculative"):
        engine.add_request(Request("r", PROMPTS[0], 8, SamplingParams(min_tokens=2)))
    engine.add_request(Request("s", PROMPTS[0], 8, SamplingParams(stop_token_ids=(7,))))  # stop ids are fine


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(stop_token_ids="12"), TypeError, "stop_token_ids must be a list"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids must be a list"),
    (dict(stop_token_ids=[1.5]), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids"),
    (dict(min_tokens=-1), ValueError, "min_tokens"),
    (dict(min_tokens="2"), TypeError, "min_tokens"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_min_tokens_above_max_new_tokens_and_stop_ids_outside_the_vocab_are_refused(tiny):
    _, runner = tiny
    with pytest.raises(ValueError, match=r"min_tokens \(9\) must be <= max_new_tokens \(8\)"):
        Request("r", PROMPTS[0], 8, SamplingParams(min_tokens=9))
    engine = make_engine("paged", runner, SimClock(), max_num_seqs=2, n_slots=256)
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, \d+\)"):
        engine.add_request(Request("r", PROMPTS[0], 8, SamplingParams(stop_token_ids=(10**6,))))


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i)."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(97 + i) for i in ids)


def test_stop_strings_wait_for_min_tokens():
    """The server's text assembler looks for stop strings only once min_tokens tokens are out (vLLM's order)."""
    from minibatch.serving.text import TextAssembler

    early = TextAssembler(Letters(), stop=["c"])
    assert early.feed([0, 1, 2, 3]) == ("ab", True)
    late = TextAssembler(Letters(), stop=["c"], min_tokens=5)
    assert late.feed([0, 1, 2, 3]) == ("abcd", False)
    assert late.feed([4, 2, 5]) == ("e", True)  # the second "c", now that 5 tokens are out


class Bytes:
    """A tokenizer whose token i is the byte i: a multi-byte character split between tokens decodes to U+FFFD until
    its last byte is out (as a byte-level BPE's byte tokens do)."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(ids).decode("utf-8", errors="replace")


def assemble(ids, stop, min_tokens=0):
    """(text sent, stopped) of a TextAssembler fed one token at a time, the last feed final."""
    from minibatch.serving.text import TextAssembler

    a, out, stopped = TextAssembler(Bytes(), stop=stop, min_tokens=min_tokens), "", False
    for k, t in enumerate(ids):
        piece, stopped = a.feed([t], final=k == len(ids) - 1)
        out += piece
        if stopped:
            break
    return out, stopped


def test_no_character_of_a_stop_string_is_sent_when_it_ends_in_a_split_character():
    """A stop string ending in a 4-byte emoji: its first characters used to be sent before the emoji's last byte
    completed the match (the text " pizza " instead of " pizza")."""
    ids = list(" pizza \U0001f600. more".encode())
    assert assemble(ids, [" \U0001f600"]) == (" pizza", True)
    assert assemble(list("\u00e9\U0001f600x".encode()), ["\u00e9\U0001f600"]) == ("", True)  # at the very start


def test_a_stop_string_that_ended_before_min_tokens_never_counts():
    """vLLM v1's rule: only a stop string ending after the text of the first min_tokens tokens counts (as a stop
    token id counts only from index min_tokens). One that ended earlier used to be found late, cutting the output
    there and leaking part of it (" 4," for " 4, 5, 6")."""
    ids = list(" 4, 5, 6, 7".encode())  # ", 5" ends with token 5
    assert assemble(ids, [", 5"], min_tokens=5) == (" 4, 5, 6, 7", False)
    assert assemble(ids, [", 5"], min_tokens=4) == (" 4", True)
    assert assemble(ids, [", 5", ", 7"], min_tokens=5) == (" 4, 5, 6", True)


@settings(max_examples=300, deadline=None)
@given(chars=st.lists(st.sampled_from(["a", "b", " ", "\u00e9", "\U0001f600"]), min_size=1, max_size=14),
       stops=st.lists(st.text(alphabet=["a", "b", " ", "\u00e9", "\U0001f600"], min_size=1, max_size=3),
                      min_size=1, max_size=3),
       min_tokens=st.integers(0, 12))
def test_text_assembler_against_a_reference(chars, stops, min_tokens):
    """Fed byte by byte: the text sent is the decoded text up to the stop string that completes first among those
    ending after the text of the first min_tokens tokens (the leftmost if several complete at one token), or all
    of it; nothing of a stop string is sent."""
    ids = list("".join(chars).encode())
    full = Bytes().decode(ids)
    stable = [len(Bytes().decode(ids[:k]).rstrip("\ufffd")) for k in range(len(ids) + 1)]
    boundary = stable[min(min_tokens, len(ids))]
    matches = [(next(k for k in range(len(ids) + 1) if stable[k] >= i + len(s)), i) for s in stops
               for i in range(len(full)) if full.startswith(s, i) and i + len(s) > boundary]
    want = (full[:min(matches)[1]], True) if matches else (full, False)
    assert assemble(ids, stops, min_tokens) == want


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_equals_the_whole_decode_on_smollm2(skip_special_tokens):
    """Decoding only the newest tokens (vLLM's incremental detokenizer) gives SmolLM2's text exactly, emoji split
    between byte tokens, CJK, accents, runs of spaces and chat markers included."""
    from minibatch.serving.bench import load_tokenizer
    from minibatch.serving.text import TextAssembler

    tokenizer = load_tokenizer("smollm2-135m")
    text = "<|im_start|>user\nHi 😀 你好，世界！ émigré  naïve\t🙂🙃<|im_end|>\n  x = [1, 2]\n\n" * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    assembler, out = TextAssembler(tokenizer, skip_special_tokens=skip_special_tokens), ""
    for k in range(0, len(ids), 3):  # a few tokens a step, as a speculative step delivers them
        out += assembler.feed(ids[k:k + 3], final=k + 3 >= len(ids))[0]
    assert out == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_banning_every_token_id_is_refused_before_a_step(tiny):
    """stop_token_ids (with EOS unless ignore_eos) covering the whole vocabulary leave min_tokens nothing to sample:
    refused at add_request naming stop_token_ids, under every policy; one id left out is accepted."""
    _, runner = tiny
    vocab, eos = runner.vocab_size, set(runner.eos_token_ids)
    for policy in ("static", "orca", "paged", "chunked"):
        engine = make_engine(policy, runner, SimClock(), config=dict(max_num_seqs=2, n_slots=256, batch_size=2))
        for ignore_eos, ids in ((True, range(vocab)), (False, [t for t in range(vocab) if t not in eos])):
            params = SamplingParams(ignore_eos=ignore_eos, min_tokens=1, stop_token_ids=tuple(ids))
            with pytest.raises(ValueError, match="stop_token_ids.*cover all"):
                engine.add_request(Request(f"all{ignore_eos}", PROMPTS[0], 4, params))
        left = Request("left", PROMPTS[0], 4, SamplingParams(ignore_eos=True, min_tokens=4,
                                                              stop_token_ids=tuple(range(1, vocab))))
        engine.generate([left])
        assert left.output_token_ids == [0] * 4  # the one id not banned
