"""Random request bodies against the OpenAI-compatible server (hypothesis): every answer is a completion (or a
stream of chunks ending in ``[DONE]``) or an OpenAI error object with a 4xx status, never a 5xx. Bodies mix the
fields the endpoints know, with values of every JSON type and range (NaN and Infinity too), and fields they do
not know. Afterwards the server still answers a plain request, and no request is left holding KV."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from minibatch.serving.background import ServerThread
from minibatch.serving.launch import build_server

MODEL = "tiny-random-llama"

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)
SMALL = st.integers(-2, 12)  # in range and just out of it, short enough to generate quickly
TOKEN_IDS = (st.lists(st.integers(-3, 600), min_size=0, max_size=6)  # the tiny vocabulary has 512 ids
             | st.just(list(range(512))))  # all of them: with min_tokens, nothing could be sampled
COMMON = {
    "model": st.sampled_from([MODEL, "gpt-9"]) | JSON,
    "max_tokens": SMALL | st.sampled_from([512, 513]) | JSON,
    "temperature": st.sampled_from([0, 0.7, 2.0, -1, 3.0]) | JSON,
    "top_p": st.sampled_from([1.0, 0.5, 0, 1.5, 1e-46, 5e-324]) | JSON,  # below float32's smallest step too
    "top_k": st.sampled_from([-1, 0, 1, 5]) | JSON,
    "seed": st.integers(-1, 2**64) | JSON,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | JSON,
    "stop_token_ids": TOKEN_IDS | JSON,
    "min_tokens": SMALL | JSON,
    "ignore_eos": st.booleans() | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON,
                                                          "continuous_usage_stats": st.booleans() | JSON}) | JSON,
    "n": st.sampled_from([1, 2]) | JSON,
    "logprobs": JSON,
    "presence_penalty": JSON,
    "user": JSON,
    "colour": JSON,  # no endpoint knows it
}
COMPLETION = COMMON | {"prompt": st.text(max_size=12) | TOKEN_IDS | JSON, "echo": JSON, "best_of": JSON}
MESSAGE = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["system", "user", "assistant", "tool"]) | JSON,
                                              "content": st.text(max_size=12) | JSON, "name": JSON})
CHAT = COMMON | {"messages": st.lists(MESSAGE, max_size=3) | JSON, "logprobs": st.booleans() | JSON,
                 "top_logprobs": JSON, "max_completion_tokens": SMALL | JSON}


def bodies(fields: dict) -> st.SearchStrategy:
    """Dicts with any subset of ``fields`` (each drawn from its strategy), or now and then not a dict at all."""
    return st.fixed_dictionaries({}, optional=fields) | JSON


@pytest.fixture(scope="module")
def server(loaded):
    app, engine = build_server(MODEL, "paged", dict(n_slots=1024, block_size=4, max_num_seqs=4), loaded=loaded)
    with ServerThread(app, engine) as srv:
        yield srv


def check_answer(r: httpx.Response, streamed: bool) -> None:
    """A 4xx with an OpenAI error object, or a 200 with choices (streamed: chunks, then ``[DONE]``)."""
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        return
    if not streamed:
        assert r.json()["choices"], r.text
        return
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk and "choices" in chunk, chunk


def post(srv, path: str, body) -> None:
    # Python's json writes NaN and Infinity, as some clients do, though JSON has neither
    r = httpx.post(srv.base_url + path, content=json.dumps(body).encode(), timeout=60,
                   headers={"content-type": "application/json"})
    check_answer(r, isinstance(body, dict) and body.get("stream") is True and r.status_code == 200)


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@FUZZ
@given(body=bodies(COMPLETION))
def test_any_completion_body_gets_a_completion_or_an_openai_error(server, body):
    post(server, "/completions", body)


@FUZZ
@given(body=bodies(CHAT))
def test_any_chat_body_gets_a_completion_or_an_openai_error(server, body):
    post(server, "/chat/completions", body)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused_as_not_finite(server, field, value):
    body = '{"model": "%s", "prompt": "x", "max_tokens": 2, "%s": %s}' % (MODEL, field, value)
    r = httpx.post(server.base_url + "/completions", content=body.encode(), timeout=60,
                   headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field and "finite number" in error["message"], error


def test_the_server_still_serves_and_holds_no_kv_after_the_fuzz(server):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    engine = server.engine.engine
    assert not engine.has_unfinished() and engine.scheduler.block_manager.num_used_blocks == 0
