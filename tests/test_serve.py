"""The OpenAI-compatible server with a real client (the official ``openai`` package) on 127.0.0.1:
outputs equal HF generate, concurrent streams share engine steps, disconnects free KV, a full queue
answers 503, bad bodies 400 naming the field. The server runs in a thread of this process (uvicorn
on a free port, one torch thread) and is stopped by its fixture."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from minibatch.reference import reference_outputs
from minibatch.request import Request, SamplingParams
from minibatch.serving.async_engine import warm_up
from minibatch.serving.background import ServerProcess, ServerThread
from minibatch.serving.launch import build_server

MODEL = "tiny-random-llama"
PROMPTS = [[5 + 7 * i + j for j in range(3 + 4 * i)] for i in range(4)]  # token ids, 3..15 tokens


@pytest.fixture(scope="module")
def server(loaded):
    app, engine = build_server(MODEL, "paged", dict(n_slots=1024, block_size=4, max_num_seqs=8),
                               loaded=loaded, keep_history=True)
    with ServerThread(app, engine) as srv:
        yield srv


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)


def reference_text(loaded, prompt_ids, max_tokens) -> str:
    model, tokenizer = loaded
    ref = reference_outputs(model, [Request("r", prompt_ids, max_tokens, SamplingParams(ignore_eos=True))])["r"]
    return tokenizer.decode(ref, skip_special_tokens=False)


def metric(srv, name: str) -> float:
    text = urllib.request.urlopen(srv.base_url.removesuffix("/v1") + "/metrics").read().decode()
    return float(re.search(rf"^minibatch:{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


EXACT = dict(temperature=0, extra_body={"ignore_eos": True, "skip_special_tokens": False})


def test_completions_equal_hf_generate(server, loaded):
    c = client(server)
    for prompt in PROMPTS:
        want = reference_text(loaded, prompt, 12)
        whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **EXACT)
        assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), 12)
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                           stream_options={"include_usage": True}, **EXACT))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        assert chunks[-1].usage.completion_tokens == 12 and chunks[-2].choices[0].finish_reason == "length"


def test_chat_uses_the_template_and_equals_hf_generate(server, loaded):
    model, tokenizer = loaded
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    want = reference_text(loaded, prompt_ids, 10)
    c = client(server)
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **EXACT)
    assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"
    usage = whole.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
           (len(prompt_ids), 10, len(prompt_ids) + 10)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True, **EXACT))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want


def test_stop_string_ends_the_text_before_it(server, loaded):
    want = reference_text(loaded, PROMPTS[1], 16)
    stop = want[5:8]
    out = client(server).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, stop=[stop], **EXACT)
    assert out.choices[0].text == want[:want.index(stop)] and out.choices[0].finish_reason == "stop"


async def stream_ids(srv, prompt, max_tokens, started: asyncio.Event | None = None) -> tuple[str, str]:
    """(request id, text) of one streamed completion; sets ``started`` after its third chunk."""
    c = openai.AsyncOpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
    text, rid = "", None
    async with c:
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True, **EXACT)
        async for i, ch in aenumerate(stream):
            rid, text = ch.id, text + ch.choices[0].text
            if started is not None and i == 2:
                started.set()
    return rid, text


async def aenumerate(it):
    i = 0
    async for x in it:
        yield i, x
        i += 1


def steps_of(engine, rid) -> list[int]:
    return [rec.step for rec in engine.trace if any(e.request_id == rid for e in rec.entries)]


class StepGate:
    """Holds the engine's step loop while closed, so a test decides which requests are queued
    before the next step runs (the tiny model steps faster than clients connect)."""

    def __init__(self, engine):
        self.engine, self.step, self.open = engine, engine.step, threading.Event()
        self.open.set()
        engine.step = self._step  # an instance attribute shadows Engine.step

    def _step(self):
        assert self.open.wait(30), "the step gate stayed closed"
        return self.step()

    def close(self):
        del self.engine.step


async def open_when_waiting(srv, gate: StepGate, n: int) -> None:
    """Open the gate once ``n`` requests wait for admission."""
    while srv.engine.num_waiting() < n:
        await asyncio.sleep(0.005)
    gate.open.set()


def test_concurrent_streams_share_steps_and_a_late_request_joins(server, loaded):
    engine = server.engine.engine
    gate = StepGate(engine)
    try:
        async def three():
            gate.open.clear()  # all three are queued before the first step that could admit them
            streams = asyncio.gather(*(stream_ids(server, p, 12) for p in PROMPTS[:3]))
            await open_when_waiting(server, gate, 3)
            return await streams

        results = asyncio.run(three())
        for (rid, text), prompt in zip(results, PROMPTS):
            assert text == reference_text(loaded, prompt, 12)  # as if it ran alone
        decode_steps = [set(steps_of(engine, rid)) for rid, _ in results]
        assert len(set.intersection(*decode_steps)) >= 6  # decoded together in the same steps

        async def late():
            started = asyncio.Event()
            first = asyncio.ensure_future(stream_ids(server, PROMPTS[3], 200, started))
            await started.wait()
            gate.open.clear()  # the first is mid-stream; hold it there until the second is queued
            second = asyncio.ensure_future(stream_ids(server, PROMPTS[0], 5))
            await open_when_waiting(server, gate, 1)
            return await first, await second

        (rid_a, _), (rid_b, text_b) = asyncio.run(late())
    finally:
        gate.open.set()
        gate.close()
    finish_a = next(rec.step for rec in engine.trace if rid_a in rec.finished)
    assert steps_of(engine, rid_b)[0] < finish_a  # admitted while the first was still streaming
    assert text_b == reference_text(loaded, PROMPTS[0], 5)


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        rid = json.loads(first[6:])["id"]
        next(line for line in lines if line.startswith("data: "))
    engine = server.engine.engine
    for _ in range(200):
        if engine.requests[rid].is_finished and metric(server, "kv_cache_usage_perc") == 0:
            break
        threading.Event().wait(0.05)
    assert engine.requests[rid].finish_reason == "abort"
    assert engine.requests[rid].num_output_tokens < 400
    assert metric(server, "kv_cache_usage_perc") == 0 and metric(server, "num_requests_running") == 0
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_disconnect_while_waiting_for_a_whole_response_aborts_and_frees_kv(server):
    """A non-streaming client that gives up (a read timeout) aborts its request: the server polls
    for the disconnect while the request runs. The step loop is held after the request's second
    token, so it is running, with KV, when the client leaves, and cannot finish on its own."""
    async_engine, engine = server.engine, server.engine.engine
    submitted, held, release, aborted = [], threading.Event(), threading.Event(), threading.Event()
    submit, abort, step = async_engine.submit, async_engine.abort, engine.step

    def recording_submit(request):
        submitted.append(request)
        return submit(request)

    def recording_abort(request_id, reason="abort"):
        aborted.set()
        abort(request_id, reason)

    def holding_step():
        if submitted and submitted[0].num_output_tokens >= 2 and not release.is_set():
            held.set()
            assert release.wait(30), "the test never released the step loop"
        return step()

    async_engine.submit, async_engine.abort, engine.step = recording_submit, recording_abort, holding_step
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 450, "ignore_eos": True}
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/completions", json=body, timeout=httpx.Timeout(30.0, read=1.0))
        assert held.wait(30) and engine.scheduler.block_manager.num_used_blocks > 0
        assert aborted.wait(30), "the server did not notice the disconnect"
    finally:
        release.set()
        del async_engine.submit, async_engine.abort, engine.step  # back to the class's methods
    request = submitted[0]
    for _ in range(200):
        if request.is_finished and metric(server, "kv_cache_usage_perc") == 0:
            break
        threading.Event().wait(0.05)
    assert request.finish_reason == "abort" and request.num_output_tokens < 450
    assert metric(server, "kv_cache_usage_perc") == 0 and engine.scheduler.block_manager.num_used_blocks == 0


GAUGES = ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc")
COUNTERS = ("num_preemptions", "prompt_tokens", "generation_tokens", "request_success")  # exposed with _total
HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "iteration_tokens_total")


def metric_families(srv) -> dict[str, tuple[str, dict[str, float]]]:
    """/metrics parsed: family name -> (type, {sample name: value summed over labels})."""
    text = urllib.request.urlopen(srv.base_url.removesuffix("/v1") + "/metrics").read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        sums: dict[str, float] = {}
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        out[family.name] = (family.type, sums)
    return out


def test_metrics_have_vllm_names_and_count_one_request(loaded):
    """A fresh server answers one request; /metrics then has every vLLM-style series under
    ``minibatch:``, and the request's tokens and latencies are counted once."""
    app, engine = build_server(MODEL, "paged", dict(n_slots=512, block_size=4), loaded=loaded)
    with ServerThread(app, engine) as srv:
        before = metric_families(srv)
        out = client(srv).completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=9, **EXACT)
        assert out.usage.completion_tokens == 9
        ttft = "minibatch:time_to_first_token_seconds"
        for _ in range(200):  # the step's metrics are recorded just after its tokens are sent
            after = metric_families(srv)
            if after.get(ttft, ("", {}))[1].get(ttft + "_count") == 1:
                break
            threading.Event().wait(0.05)
    want = {**{f"minibatch:{n}": "gauge" for n in GAUGES}, **{f"minibatch:{n}": "counter" for n in COUNTERS},
            **{f"minibatch:{n}": "histogram" for n in HISTOGRAMS}}
    assert {name: after[name][0] for name in want if name in after} == want

    def grew(family: str, sample: str) -> float:
        name = "minibatch:" + family
        return after[name][1][name + sample] - before.get(name, ("", {}))[1].get(name + sample, 0.0)

    assert grew("time_to_first_token_seconds", "_count") == 1 and grew("e2e_request_latency_seconds", "_count") == 1
    assert grew("time_per_output_token_seconds", "_count") == 1 and grew("inter_token_latency_seconds", "_count") == 8
    assert grew("generation_tokens", "_total") == 9 and grew("prompt_tokens", "_total") == len(PROMPTS[2])
    assert grew("request_success", "_total") == 1 and grew("num_preemptions", "_total") == 0
    assert grew("iteration_tokens_total", "_sum") == len(PROMPTS[2]) + 9 - 1  # the last token is never fed back
    assert after["minibatch:kv_cache_usage_perc"][1]["minibatch:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 600}, "max_tokens"),  # prompt + max_tokens > max_model_len 512
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"prompt": "x", "logprobs": 1}, "logprobs"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "colour": "red"}, "colour"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": ["a", "b"]}, "prompt"),
    # no silent coercion from another JSON type
    ({"prompt": "x", "max_tokens": "4"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 4.0}, "max_tokens"),
    ({"prompt": "x", "stream": "no"}, "stream"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "x", "top_k": "5"}, "top_k"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "seed": "7"}, "seed"),
    ({"prompt": None}, "prompt"),  # null is "not given": a required field is then missing
    ({"prompt": list(range(5, 600))}, "prompt"),  # the prompt alone exceeds max_model_len 512: not max_tokens'
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"prompt": "x", "min_tokens": "3"}, "min_tokens"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [99999999]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": "7"}, "stop_token_ids"),
    # every token id banned before min_tokens: nothing could be sampled (it used to stop the engine)
    ({"prompt": "x", "min_tokens": 1, "stop_token_ids": list(range(512)), "temperature": 1.0}, "stop_token_ids"),
    ({"prompt": "x", "min_tokens": 1, "stop_token_ids": list(range(512)), "ignore_eos": True}, "stop_token_ids"),
    # an unsupported parameter's no-op value only in its own JSON type: 0 is not false, 1.0 not the count 1
    ({"prompt": "x", "logprobs": 0}, "logprobs"),
    ({"prompt": "x", "n": 1.0}, "n"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"prompt": "x", "colour": None}, "colour"),  # an unknown field is refused even when null
    ({"prompt": "x", "stop_token_ids": [7] * 1025}, "stop_token_ids"),  # millions slowed every request
])
def test_bad_bodies_get_400_naming_the_field(server, body, param):
    r = httpx.post(server.base_url + "/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"


def test_other_bad_requests(server):
    r = httpx.post(server.base_url + "/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/completions", json={"model": "gpt-9", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(server.base_url + "/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client(server).completions.create(model=MODEL, prompt="x", logprobs=2)
    assert httpx.get(server.base_url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def test_tiny_top_p_keeps_the_most_likely_token_and_no_op_values_are_accepted(server):
    """A top_p below float32's smallest step (1e-46 rounds to 0) keeps the most likely token, so sampling is
    greedy; it used to drop every token and stop the engine. No-op values of unsupported parameters pass."""
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 6, "ignore_eos": True}
    greedy = httpx.post(server.base_url + "/completions", json=body | {"temperature": 0}, timeout=60).json()
    for top_p in (1e-46, 5e-324, 1e-30):
        r = httpx.post(server.base_url + "/completions", json=body | {"temperature": 1.0, "top_p": top_p, "seed": 3},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy["choices"][0]["text"], r.text
    no_ops = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0, "logprobs": False, "best_of": 1}
    assert httpx.post(server.base_url + "/completions", json=body | no_ops, timeout=60).status_code == 200
    huge = httpx.post(server.base_url + "/completions", json=body | {"temperature": "h" * 100_000}, timeout=60)
    assert huge.status_code == 400 and len(huge.json()["error"]["message"]) < 400  # the value is not sent back whole
    assert httpx.get(server.base_url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def test_a_kv_cache_smaller_than_the_model_context_is_the_servers_context(loaded, capsys):
    """/v1/models, defaults and errors use the most tokens one request can hold (here the KV cache's, below the
    model's max_model_len 512), in tokens, naming max_tokens or prompt."""
    from minibatch.serving.protocol import APIError, ChatCompletionRequest, Context, make_request, parse_body

    app, engine = build_server(MODEL, "paged", dict(n_slots=64, block_size=4, max_num_seqs=2), loaded=loaded)
    limit = engine.engine.max_request_tokens()
    assert 32 < limit <= 64 and app.state.context == Context(limit, 512)
    with ServerThread(app, engine) as srv:
        assert httpx.get(srv.base_url + "/models").json()["data"][0]["max_model_len"] == limit
        prompt = list(range(5, 15))
        r = httpx.post(srv.base_url + "/completions", json={"prompt": prompt, "max_tokens": limit}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "max_tokens" and f"at most {limit - 10}" in error["message"]
        assert f"context of {limit} tokens (the model's max_model_len is 512" in error["message"]
        r = httpx.post(srv.base_url + "/completions", json={"prompt": prompt, "max_tokens": limit - 10,
                                                           "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == limit - 10
        r = httpx.post(srv.base_url + "/completions", json={"prompt": list(range(5, 5 + limit))}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    chat = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    assert make_request(chat, prompt, None, Context(limit, 512), chat=True).max_new_tokens == limit - 10
    chat = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                              "max_completion_tokens": limit})  # named as the body named it
    with pytest.raises(APIError, match="^max_completion_tokens: prompt") as e:
        make_request(chat, prompt, chat.max_new_tokens, Context(limit, 512), chat=True)
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(SystemExit) as e:  # a KV cache that holds no request: refused at start, not served
        from minibatch.__main__ import main
        main(["serve", "--model", MODEL, "--policy", "orca", "--n-slots", "1", "--port", "1"])
    assert e.value.code == 2 and "no request fits this server's KV cache" in capsys.readouterr().err


def test_full_queue_answers_503_with_retry_after(loaded):
    # a static batch of 4 waits up to 60 s to fill: the first request waits, the second finds the queue full
    app, engine = build_server(MODEL, "static", dict(batch_size=4, max_wait_s=60.0), loaded=loaded,
                               max_num_waiting=1)
    with ServerThread(app, engine) as srv:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=30) as first:
            assert first.status_code == 200
            r = httpx.post(srv.base_url + "/completions", json={**body, "stream": False}, timeout=30)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "max_num_waiting=1" in r.json()["error"]["message"]
        assert httpx.get(srv.base_url.removesuffix("/v1") + "/health").status_code == 200


def test_burst_of_200_at_concurrency_64_all_complete(server):
    from minibatch.serving.bench import BenchRequest, bench

    requests = [BenchRequest(prompt="hello " * (1 + i % 7), prompt_len=1 + i % 7, output_len=4 + i % 5)
                for i in range(200)]
    result = bench(server.base_url, MODEL, requests, max_concurrency=64, ignore_eos=True, progress=False)
    summary = result["summary"]
    assert summary["completed"] == 200 and summary["failed"] == 0
    assert [r["output_tokens"] for r in result["requests"]] == [x.output_len for x in requests]
    assert httpx.get(server.base_url.removesuffix("/v1") + "/health").json() == {"status": "ok"}
    assert metric(server, "num_requests_running") == 0 and metric(server, "kv_cache_usage_perc") == 0


def test_serve_command_runs_as_a_process(tmp_path):
    log = tmp_path / "server.log"
    argv = ["--model", MODEL, "--policy", "chunked", "--threads", "1", "--n-slots", "512", "--dtype", "float32"]
    with ServerProcess(argv, str(log)) as p:
        out = openai.OpenAI(base_url=p.base_url, api_key="none", max_retries=0).completions.create(
            model=MODEL, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
    assert p.proc.returncode is not None  # stopped: no process left behind


HEALTH_STUB = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_server_process_left_running_ends_with_the_interpreter(tmp_path):
    """A notebook whose cell failed between start() and stop(): the child still ends at exit."""
    (tmp_path / "stub.py").write_text(HEALTH_STUB)
    parent = (f"import sys; from minibatch.serving.background import ServerProcess; "
              f"p = ServerProcess([], {str(tmp_path / 'stub.log')!r}, "
              f"command=[sys.executable, {str(tmp_path / 'stub.py')!r}, '{{port}}']).start(); print(p.proc.pid)")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return  # ended (and reaped) when its parent exited
    os.kill(pid, signal.SIGTERM)
    pytest.fail(f"the child server {pid} outlived its parent")


@pytest.mark.parametrize("policy", ["static", "orca", "chunked"])
def test_every_policy_serves_a_burst(loaded, policy):
    """A long-running server (no keep_history) under each policy: 24 concurrent streams all finish,
    and a later one too (a static batch's finished members stay in their padded batch)."""
    from minibatch.serving.bench import BenchRequest, bench

    app, engine = build_server(MODEL, policy, dict(batch_size=4, max_num_seqs=4, max_wait_s=0.05), loaded=loaded)
    with ServerThread(app, engine) as srv:
        requests = [BenchRequest(prompt="hi " * (1 + i % 5), prompt_len=1 + i % 5, output_len=3 + i % 4)
                    for i in range(24)]
        for _ in range(2):
            summary = bench(srv.base_url, MODEL, requests, ignore_eos=True, progress=False)["summary"]
            assert summary["completed"] == 24 and summary["failed"] == 0
        assert engine.is_alive


def test_a_port_in_use_is_refused_before_the_model_loads(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit) as e:
            from minibatch.__main__ import main
            main(["serve", "--model", "tiny-random-llama", "--port", str(taken.getsockname()[1])])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cannot listen there" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,names", [
    (["serve", "--policy", "hf_generate"], "--policy"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--port", "0"], "--port"),
    (["serve", "--host", ""], "--host"),
    (["serve", "--host", "no-such-host.invalid"], "--host"),
    (["serve", "--max-num-waiting", "1000000000000"], "--max-num-waiting"),
    (["serve", "--max-num-waiting", "0"], "--max-num-waiting"),
    (["serve", "--drain-timeout-s", "-1"], "--drain-timeout-s"),
    (["serve", "--drain-timeout-s", "nan"], "--drain-timeout-s"),
    (["serve", "--max-body-bytes", "10"], "--max-body-bytes"),
    (["bench-serve", "--base-url", "http://127.0.0.1:9", "--rate", "0"], "--rate"),
    (["bench-serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "0"], "--num-prompts"),
])
def test_serving_commands_refuse_bad_options_in_one_line(argv, names, capsys):
    from minibatch.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and names in err and len(err.strip().splitlines()) == 1, err


def test_null_means_default_where_openai_allows_it(server):
    """The OpenAI spec makes most parameters nullable: null is the default, never an error."""
    nulls = {k: None for k in ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream",
                               "stop", "seed", "logprobs", "user", "stream_options", "best_of", "logit_bias")}
    r = httpx.post(server.base_url + "/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3,
                                                           "ignore_eos": True, **nulls}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_stop_token_ids_and_min_tokens_are_honoured(server, loaded):
    """vLLM's ``stop_token_ids`` end the output at that token (finish_reason "stop"); ``min_tokens`` bans it until
    that many tokens are out (tests/test_stop_tokens.py checks the tokens against HF generate)."""
    model, tokenizer = loaded
    free = reference_outputs(model, [Request("f", PROMPTS[2], 10, SamplingParams(ignore_eos=True))])["f"]
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [free[1]], "skip_special_tokens": False}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] <= 2
    r = httpx.post(server.base_url + "/completions", json=body | {"min_tokens": 10}, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 10


def test_continuous_usage_stats_puts_usage_in_every_chunk(server):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it): every chunk carries the usage so far."""
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usages = [e["usage"]["completion_tokens"] for e in events]
    assert len(usages) == len(events) and usages == sorted(usages) and usages[-1] == 4


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nope", 404), ("POST", "/v2/completions", 404),
                                                ("GET", "/v1/completions", 405), ("DELETE", "/health", 405),
                                                ("POST", "/v1/completions/", 404),  # no 307 redirect, empty body
                                                ("POST", "/v1/chat/completions/", 404), ("GET", "/health/", 404)])
def test_unknown_routes_and_methods_get_openai_error_objects(server, method, path, status):
    r = httpx.request(method, server.base_url.removesuffix("/v1") + path, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and path in error["message"]


def test_oversized_and_hostile_bodies_get_4xx_not_500(loaded):
    """A body over --max-body-bytes is refused (413) before it is read whole; a lone surrogate or JSON nested too
    deeply is a 400, never a 500; the server keeps serving."""
    app, engine = build_server(MODEL, "paged", dict(n_slots=512, block_size=4), loaded=loaded,
                               max_body_bytes=4096)
    with ServerThread(app, engine) as srv:
        url = srv.base_url + "/completions"
        big = {"model": MODEL, "prompt": "x" * 5000}
        r = httpx.post(url, json=big, timeout=30)
        assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit holds while reading
            yield json.dumps(big).encode()

        r = httpx.post(url, content=chunks(), timeout=30)
        assert r.status_code == 413
        r = httpx.post(url, content=b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode(), timeout=30)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
        r = httpx.post(url, content=b"[" * 2000 + b"]" * 2000, timeout=30)  # too deep for json, or not an object
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        out = client(srv).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, **EXACT)
        assert out.usage.completion_tokens == 2


def test_huge_bodies_are_refused_cheaply_and_a_large_valid_one_is_served(server):
    """A million token ids, a batch of a million prompts, a million stop strings or stop token ids, a million
    unknown values: 400 before the body is parsed (more JSON values than a request for the context can need;
    parsing them held the GIL, and every other request, for a second), the value not sent back. Lists that are too
    long but parse cheaply: 400 naming the field. A valid body over 256 KiB (prepared in the large bodies' own
    thread, as is any body over 8 bytes per token of the context) answers as the same small one does. A body must
    be UTF-8 (an encoded surrogate is refused; a BOM is dropped)."""
    url = server.base_url + "/completions"
    small = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for field, value in [("prompt", list(range(10**6))), ("prompt", ["ab"] * 10**6), ("stop", ["x"] * 10**6),
                         ("stop_token_ids", [7] * 10**6), ("zzz", [[1]] * 10**6)]:
        r = httpx.post(url, json=small | {field: value}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and "JSON values" in error["message"] and len(error["message"]) < 400, error
    for field, value, message in [("prompt", list(range(5, 600)), "595 tokens do not fit"),
                                  ("prompt", ["ab"] * 5000, "one prompt per request is supported, got 5000"),
                                  ("stop", ["x"] * 5000, "(5000 items)")]:
        r = httpx.post(url, json=small | {field: value}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and message in error["message"], error
        assert len(error["message"]) < 400
    want = httpx.post(url, json=small, timeout=60).json()["choices"][0]["text"]
    large = httpx.post(url, json=small | {"user": "u" * (300 << 10)}, timeout=60)
    assert large.status_code == 200 and large.json()["choices"][0]["text"] == want
    bom = httpx.post(url, content=b"\xef\xbb\xbf" + json.dumps(small).encode(), timeout=60)
    assert bom.status_code == 200 and bom.json()["choices"][0]["text"] == want
    pair = httpx.post(url, content=json.dumps(small | {"user": "\U0001f600"}).encode(), timeout=60)  # "\ud83d\ude00"
    assert pair.status_code == 200
    encoded = httpx.post(url, content=b'{"prompt": "a\xed\xa0\x80b"}', timeout=60)
    assert encoded.status_code == 400 and "not UTF-8" in encoded.json()["error"]["message"]


def test_a_list_of_messages_that_cannot_fit_is_refused_before_it_is_read(loaded):
    """Under a template that marks each message with special tokens (never merged with the text), N messages take
    at least N times that many tokens: more than the context is refused before any message is validated."""
    import copy

    from minibatch.serving.bench import load_tokenizer
    from minibatch.serving.text import template_tokens_per_message

    assert template_tokens_per_message(load_tokenizer("smollm2-135m")) == 2  # <|im_start|> and <|im_end|>
    assert template_tokens_per_message(loaded[1]) == 0  # the test template's markers are plain text
    tokenizer = copy.deepcopy(loaded[1])
    tokenizer.chat_template = "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"
    assert template_tokens_per_message(tokenizer) == 2
    app, engine = build_server(MODEL, "paged", dict(n_slots=1024, block_size=4), loaded=(loaded[0], tokenizer))
    with ServerThread(app, engine) as srv:
        url = srv.base_url + "/chat/completions"
        body = {"model": MODEL, "max_tokens": 2, "ignore_eos": True}
        r = httpx.post(url, json=body | {"messages": [{"role": "user", "content": "hi"}] * 256}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "256 messages take at least 2 tokens each" in r.json()["error"]["message"]
        r = httpx.post(url, json=body | {"messages": [{"role": "user", "content": "hi"}] * 10}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_routes_clients_expect_and_errors_that_name_the_right_thing(server, loaded):
    """models.retrieve (the openai client's GET /v1/models/{id}), HEAD /health, a 404 that does not send a 60k
    path back, a chat prompt too long blamed on messages (chat has no prompt), a message's name reaching the chat
    template (it was dropped)."""
    import copy

    c = client(server)
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other")
    root = server.base_url.removesuffix("/v1")
    assert httpx.head(root + "/health").status_code == 200
    r = httpx.get(root + "/" + "a" * 60_000)
    assert r.status_code == 404 and len(r.json()["error"]["message"]) < 400
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.json()
    tokenizer = copy.deepcopy(loaded[1])
    tokenizer.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m.get('name', '') }}{{ m['content'] }}\n" \
                              "{% endfor %}"
    app, engine = build_server(MODEL, "paged", dict(n_slots=1024, block_size=4), loaded=(loaded[0], tokenizer))
    with ServerThread(app, engine) as srv:
        usage = [client(srv).chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": "hi"} | name]).usage.prompt_tokens for name in ({}, {"name": "Ada"})]
    assert usage[1] > usage[0]


def test_chat_messages_a_client_sends_back_and_what_a_template_refuses(loaded):
    """An SDK message's model_dump() (refusal, tool_calls, ... null) is taken as the message; a refusal with a
    value, an extra key in a content part and a template's raise_exception are 400s naming messages, not 500s."""
    import copy

    tokenizer = copy.deepcopy(loaded[1])
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role "
                               "not supported') }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}")
    app, engine = build_server(MODEL, "paged", dict(n_slots=1024, block_size=4), loaded=(loaded[0], tokenizer))
    with ServerThread(app, engine) as srv:
        answer = client(srv).chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hi"}]).choices[0].message
        dumped = answer.model_dump()
        assert dumped["refusal"] is None and "tool_calls" in dumped
        again = client(srv).chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hi"}, dumped, {"role": "user", "content": "more"}])
        assert again.choices[0].message.content is not None
        for messages in ([{"role": "user", "content": "hi"}, dumped | {"refusal": "no"}],
                         [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}],
                         [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]):
            r = httpx.post(srv.base_url + "/chat/completions", timeout=60,
                           json={"model": MODEL, "messages": messages, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.json()
        assert "System role not supported" in r.json()["error"]["message"]


def test_a_developer_message_is_a_system_message_unless_the_template_names_the_role(loaded):
    """OpenAI's developer role is the newer name of system: a template that does not name it gets ``system`` (the
    same prompt as a system message), one that does gets ``developer``."""
    import copy

    from minibatch.serving.text import template_role

    def prompt_tokens(template: str, role: str) -> int:
        tokenizer = copy.deepcopy(loaded[1])
        tokenizer.chat_template = template
        app, engine = build_server(MODEL, "paged", dict(n_slots=1024, block_size=4), loaded=(loaded[0], tokenizer))
        with ServerThread(app, engine) as srv:
            return client(srv).chat.completions.create(model=MODEL, max_tokens=1, messages=[
                {"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]).usage.prompt_tokens

    generic = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    assert prompt_tokens(generic, "developer") == prompt_tokens(generic, "system")
    naming = "{% for m in messages %}{% if m['role'] == 'developer' %}<|dev|>{% else %}<|{{ m['role'] }}|>{% endif %}" \
             "{{ m['content'] }}\n{% endfor %}"
    assert prompt_tokens(naming, "developer") != prompt_tokens(naming, "system")
    tokenizer = SimpleNamespace(chat_template=generic)
    assert [template_role(tokenizer, r) for r in ("developer", "system", "user", "assistant")] == \
        ["system", "system", "user", "assistant"]
    assert template_role(SimpleNamespace(chat_template=naming), "developer") == "developer"


def test_health_is_503_while_draining_and_after(loaded):
    """A load balancer stops sending to a draining server; a request after the drain ended is told the server is
    shutting down (503 with Retry-After), not "the engine loop is not running: None"."""
    app, engine = build_server(MODEL, "paged", dict(n_slots=256, block_size=4), loaded=loaded)
    with ServerThread(app, engine) as srv:
        root = srv.base_url.removesuffix("/v1")
        assert engine.drain(5.0) == 0
        r = httpx.get(root + "/health")
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        engine.shutdown()
        r = httpx.post(srv.base_url + "/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"] and "retry-after" in r.headers


def test_the_chat_role_chunk_comes_with_the_first_token(server):
    """The first chat chunk (the role) is sent when the first token is, not before the request is scheduled: a
    client's time to first chunk is the TTFT (vLLM does the same)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
    assert 1 <= len(events) <= 3  # one chunk per token at most: no role-only chunk ahead of the tokens


def test_a_burst_to_an_idle_server_fills_its_free_slots_before_any_503(loaded):
    """Room for 2 running + 4 waiting: a burst of 6 at once is all accepted (2 of them are admitted at the next
    step: they do not wait, so they do not count as waiting)."""
    app, engine = build_server(MODEL, "paged", dict(n_slots=1024, block_size=4, max_num_seqs=2), loaded=loaded,
                               max_num_waiting=4)
    with ServerThread(app, engine) as srv:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "ignore_eos": True}

        async def burst(n):
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(srv.base_url + "/completions", json=body) for _ in range(n)))

        assert [r.status_code for r in asyncio.run(burst(6))] == [200] * 6


def test_slow_templating_and_tokenizing_never_stall_the_event_loop(loaded, monkeypatch):
    """Decoding, templating and tokenizing a body run off the event loop: while one body takes 1.5 s to template,
    /health answers at once and an open stream keeps its pace (gaps under 1 s). A text too long for the context is
    refused before it is templated or tokenized."""
    import time

    model, tokenizer = loaded
    app, engine = build_server(MODEL, "paged", dict(n_slots=2048, block_size=4, max_num_seqs=4), loaded=loaded)
    real_template = tokenizer.apply_chat_template

    def slow_template(*a, **k):
        time.sleep(1.5)
        return real_template(*a, **k)

    with ServerThread(app, engine) as srv:
        gaps, started = [], threading.Event()

        def stream():
            body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 120, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=60) as r:
                last = None
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        started.set()

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert started.wait(30)
        monkeypatch.setattr(tokenizer, "apply_chat_template", slow_template)
        chat = threading.Thread(target=lambda: httpx.post(srv.base_url + "/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        chat.start()
        time.sleep(0.3)  # the chat body is being templated now
        t0 = time.perf_counter()
        assert httpx.get(srv.base_url.removesuffix("/v1") + "/health", timeout=30).status_code == 200
        health_s = time.perf_counter() - t0
        chat.join()
        streamer.join()
        monkeypatch.setattr(tokenizer, "apply_chat_template", real_template)
        too_long = httpx.post(srv.base_url + "/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "word " * 200_000}]})
    assert health_s < 1.0 and max(gaps) < 1.0, (health_s, max(gaps))
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "messages"
    assert "cannot fit this server's context of 512 tokens" in too_long.json()["error"]["message"]


def test_a_body_longer_than_a_full_context_is_tokenized_in_the_large_lane(loaded, monkeypatch):
    """The small bodies' thread tokenizes at most about what a prompt that fills the context costs (8 bytes a
    token, at least 16 KiB): a text prompt far past the context, but under 256 KiB, goes to the large bodies'
    thread, so a stream of them cannot hold up a "hi" (they still get a 400 naming prompt)."""
    model, tokenizer = loaded
    lanes, real_encode, vocab = [], tokenizer.encode, tokenizer.get_vocab()
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: lanes.append(threading.current_thread().name)
                        or real_encode(*a, **k))  # (the large lane's deep copy keeps this wrapper)
    # a 100-character token, as real vocabularies have (runs of spaces): 512 tokens could then be 51,200 characters,
    # so these prompts are not refused by their length alone
    monkeypatch.setattr(tokenizer, "get_vocab", lambda: vocab | {" " * 100: len(vocab)})
    app, engine = build_server(MODEL, "paged", dict(n_slots=2048, block_size=4, max_num_seqs=4), loaded=loaded)
    with ServerThread(app, engine) as srv:
        url = srv.base_url + "/completions"
        lanes.clear()
        for words in (2, 3000, 8000):  # 10 bytes, about 15 KiB, about 40 KiB
            r = httpx.post(url, json={"model": MODEL, "prompt": "word " * words, "max_tokens": 1}, timeout=60)
            assert r.status_code == (200 if words == 2 else 400), r.text
    assert [name.rsplit("_", 1)[0] for name in lanes] == ["minibatch-prepare-small"] * 2 + ["minibatch-prepare-large"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_drains_and_every_open_stream_gets_its_final_event(tmp_path, sig):
    """SIGTERM or SIGINT with 20 open streams: new requests get 503 at once, the open ones run on until
    --drain-timeout-s, then each ends with a final chunk (finish_reason "length" or "abort") and [DONE]; the
    process then exits."""
    import time

    argv = ["--model", MODEL, "--policy", "paged", "--threads", "1", "--n-slots", "16384", "--max-num-seqs", "32",
            "--dtype", "float32", "--drain-timeout-s", "1"]
    p = ServerProcess(argv, str(tmp_path / "server.log")).start()
    results, started = {}, threading.Barrier(21)

    def stream(i):
        body = {"model": MODEL, "prompt": PROMPTS[i % 4], "max_tokens": 480, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", p.base_url + "/completions", json=body, timeout=120) as r:
            for n, line in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
                events.append(line[6:])
                if n == 1:
                    started.wait(60)
        results[i] = events

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    started.wait(60)  # every stream has its first tokens
    p.proc.send_signal(sig)
    time.sleep(0.3)
    refused = httpx.post(p.base_url + "/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                         timeout=30)
    for t in threads:
        t.join(120)
    p.proc.wait(60)
    p.stop()
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    # uvicorn re-raises the signal once it has shut down: the exit status is the signal's (or 130 for Ctrl-C)
    assert len(results) == 20 and p.proc.returncode in (0, -sig, 130)
    for events in results.values():
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "abort")
    assert any(json.loads(e[-2])["choices"][0]["finish_reason"] == "abort" for e in results.values())


def test_serve_builds_and_steps_the_engine_in_one_thread():
    """``serve`` loads the model and steps the engine in the same (non-main) thread, so the process keeps one
    OpenMP pool (AsyncEngine.run_in_this_thread says why); a failed build raises in the caller's thread."""
    import threading

    from minibatch.serving.launch import build_in_engine_thread

    seen, stepped = {}, threading.Event()

    class FakeEngine:
        def run_in_this_thread(self):
            seen["loop"] = threading.current_thread()
            stepped.set()

    def build():
        seen["build"] = threading.current_thread()
        return "app", FakeEngine()

    threads = torch.get_num_threads()
    try:
        app, engine = build_in_engine_thread(build, threads=1)
        assert app == "app" and stepped.wait(5)
        assert seen["build"] is seen["loop"] and seen["build"] is not threading.main_thread()

        def bad():
            raise ValueError("--policy must be one of ...")

        with pytest.raises(ValueError, match="--policy must be one of"):
            build_in_engine_thread(bad, threads=1)
    finally:
        torch.set_num_threads(threads)


def test_union_fields_name_their_forms_and_completions_default_max_tokens_fits(server):
    """A value no form of a union field takes names the forms (not the first form's complaint); an empty string
    prompt is empty; completions' default max_tokens (16) shrinks to what fits, an explicit one is refused."""
    url = server.base_url + "/completions"
    bad = httpx.post(url, json={"model": MODEL, "prompt": [True, False]}, timeout=30).json()["error"]
    assert bad["message"].startswith("prompt: must be one of str | list[int]") and bad["param"] == "prompt"
    assert httpx.post(url, json={"prompt": "x", "stop": 5}, timeout=30).json()["error"]["message"].startswith(
        "stop: must be one of str | list[str]")
    for empty in ("", [""], [[]]):
        assert httpx.post(url, json={"prompt": empty}, timeout=30).json()["error"]["message"] == \
            "prompt: must not be empty"
    capital = httpx.post(url, json={"prompt": "x", "Temperature": 0.5}, timeout=30).json()["error"]
    assert capital["message"].startswith("Temperature: unknown field") and capital["param"] == "Temperature"
    huge = httpx.post(url, json={"prompt": "x", "k" * 100_000: 1}, timeout=30).json()["error"]  # not echoed whole
    assert huge["param"] == "k" * 64 + "... (100000 characters)" and len(huge["message"]) < 400, huge
    context = httpx.get(server.base_url + "/models", timeout=30).json()["data"][0]["max_model_len"]
    prompt = [5] * (context - 3)
    fits = httpx.post(url, json={"prompt": prompt, "ignore_eos": True}, timeout=60).json()
    assert fits["usage"]["completion_tokens"] == 3 and fits["choices"][0]["finish_reason"] == "length"
    asked = httpx.post(url, json={"prompt": prompt, "max_tokens": 16}, timeout=60).json()["error"]
    assert asked["param"] == "max_tokens" and "at most 3" in asked["message"]


def test_metrics_are_updated_before_a_request_gets_its_last_token(server):
    """The engine loop updates /metrics before it delivers a step's tokens: a client that has its whole response
    reads no running request for it (it read the step before, now and then)."""
    c = client(server)
    for _ in range(20):
        c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)
        assert metric(server, "num_requests_running") == 0


def test_the_server_warms_up_on_a_throwaway_engine(loaded, monkeypatch):
    """Before it listens, the server runs one short request on a throwaway engine over the same runner (the model's
    first forwards are slow); the served engine has none of it. A static batch does not wait for others to fill."""
    from minibatch.serving import launch

    warmed = []
    monkeypatch.setattr(launch, "warm_up", lambda engine: warmed.append((engine, warm_up(engine))))
    for policy, settings in (("paged", dict(n_slots=256, block_size=4)), ("static", dict(max_wait_s=60.0))):
        app, engine = build_server(MODEL, policy, settings, loaded=loaded, start=False)
        throwaway, seconds = warmed.pop()
        assert throwaway is not engine.engine and throwaway.executor is engine.engine.executor and seconds < 30
        done = throwaway.requests["warmup"]
        assert done.is_finished and len(done.output_token_ids) == 4 and done.num_prompt_tokens == 16
        assert not engine.engine.requests and not engine.engine.trace
        engine.shutdown()
    app, engine = build_server(MODEL, "paged", dict(n_slots=4, block_size=4), loaded=loaded, start=False)
    done = warmed.pop()[0].requests["warmup"]  # a KV cache of 4 token slots: the warm-up fits in it
    assert done.num_prompt_tokens + done.max_new_tokens <= 4 and done.is_finished
    engine.shutdown()


def test_a_policy_that_cannot_run_a_lone_request_still_starts(loaded, capsys):
    """The warm-up is best effort: a policy of one's own that admits nothing while one request waits alone (the
    engine raises "cannot schedule") starts cold, with a warning line, instead of failing to start."""
    from minibatch.policies import POLICIES, register_policy
    from minibatch.scheduler import PagedScheduler

    class WaitForTwo(PagedScheduler):
        name = "wait_for_two"

        def schedule(self, now_s):
            if len(self.waiting) == 1 and not self.running:
                return self.finish_output(self.begin_step())
            return super().schedule(now_s)

    register_policy("wait_for_two", WaitForTwo, replace=True)
    try:
        app, engine = build_server(MODEL, "wait_for_two", dict(n_slots=256), loaded=loaded, start=False)
        assert "warning: no warm-up (scheduler wait_for_two cannot schedule" in capsys.readouterr().out
        assert not engine.engine.requests
        engine.shutdown()
    finally:
        POLICIES.pop("wait_for_two")
