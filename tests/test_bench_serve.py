"""bench-serve, the client-side load generator, against a stub OpenAI-compatible server.

The stub is written unlike our server on purpose: the standard library's ThreadingHTTPServer, streaming
a fixed number of fixed-text SSE chunks with fixed sleeps (first chunk after FIRST_DELAY_S, then one
every GAP_S), a usage chunk when asked, then ``data: [DONE]``. It counts the requests open at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from minibatch.metrics import SLO
from minibatch.models import tiny_tokenizer
from minibatch.serving import bench as bench_mod
from minibatch.serving.bench import (BenchRequest, add_bench_serve_arguments, api_base, bench, default_tokenizer_name,
                                     first_model_id, run_bench_serve, sample_requests)
from minibatch.serving.bench_stats import arrival_offsets, summarize

FIRST_DELAY_S, GAP_S, TEXT = 0.05, 0.02, "tok "


class Stub:
    """Settings and counters of one stub server (read by its handler threads)."""

    def __init__(self, chunks=4, tokens_per_chunk=2, usage=True, fail_marker=None, first_delay_s=FIRST_DELAY_S,
                 finish_reason="length", usage_tokens=None):
        self.chunks, self.tokens_per_chunk, self.usage = chunks, tokens_per_chunk, usage
        self.fail_marker, self.first_delay_s = fail_marker, first_delay_s
        self.finish_reason, self.usage_tokens = finish_reason, usage_tokens  # None: none sent; the usage's count
        self.lock, self.stopping = threading.Lock(), threading.Event()  # set at teardown: sleeps end at once
        self.open = self.max_open = 0
        self.bodies: list[dict] = []


def _handler(stub: Stub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _send_json(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _event(self, obj) -> None:
            self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
            self.wfile.flush()

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._send_json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model",
                                                                   "created": 0, "owned_by": "stub"}]})
            else:
                self._send_json(404, {"error": {"message": "not found"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            chat = self.path == "/v1/chat/completions"
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            with stub.lock:
                stub.bodies.append(body)
                stub.open += 1
                stub.max_open = max(stub.max_open, stub.open)
            try:
                self._answer(body, chat, prompt)
            finally:
                self._leave()

        def _leave(self):
            if not getattr(self, "left", False):
                self.left = True
                with stub.lock:
                    stub.open -= 1

        def _answer(self, body: dict, chat: bool, prompt: str) -> None:
            if stub.fail_marker and stub.fail_marker in prompt:
                self._leave()  # before the client can see the answer, so a freed slot is free here too
                self._send_json(500, {"error": {"message": "stub failure", "type": "server_error"}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            head = {"id": "x", "created": 0, "model": body["model"]}
            if chat:  # a role-only chunk carries no text: not a token
                self._event({**head, "object": "chat.completion.chunk",
                             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for k in range(stub.chunks):
                if stub.stopping.wait(stub.first_delay_s if k == 0 else GAP_S):
                    return
                choice = {"index": 0, "delta": {"content": TEXT}} if chat else {"index": 0, "text": TEXT}
                last = k == stub.chunks - 1
                self._event({**head, "object": "chat.completion.chunk" if chat else "text_completion",
                             "choices": [{**choice, "finish_reason": stub.finish_reason if last else None}]})
            if stub.usage and (body.get("stream_options") or {}).get("include_usage"):
                n = stub.chunks * stub.tokens_per_chunk if stub.usage_tokens is None else stub.usage_tokens
                self._event({**head, "object": "chat.completion.chunk" if chat else "text_completion", "choices": [],
                             "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": None}})
            self._leave()
            self._event(b"[DONE]")

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins the handler threads: none is left behind
    request_queue_size = 128  # a burst of connects must not overflow the listen backlog

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that timed out and hung up is fine
            super().handle_error(request, client_address)


@pytest.fixture
def start_stub():
    """start_stub(**Stub options) -> (base_url without /v1, stub); every server is shut down afterwards."""
    running = []

    def start(**options):
        stub = Stub(**options)
        server = _Server(("127.0.0.1", 0), _handler(stub))
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        thread.start()
        running.append((server, thread, stub))
        return f"http://127.0.0.1:{server.server_address[1]}", stub

    yield start
    for server, thread, stub in running:
        stub.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        assert not thread.is_alive()
    assert not [t for t in threading.enumerate() if "process_request_thread" in t.name]  # handler threads


def _requests(n: int, output_len: int = 8, fail_every: int | None = None) -> list[BenchRequest]:
    return [BenchRequest(("FAIL " if fail_every and i % fail_every == 0 else "") + f"prompt {i}", 3, output_len)
            for i in range(n)]


def _check_record(r: dict, chunks: int) -> None:
    """The record's metrics equal those recomputed from its own timestamps, exactly."""
    times, send = r["chunk_times_s"], r["send_time_s"]
    assert len(times) == chunks and r["text"] == TEXT * chunks
    assert r["ttft_s"] == times[0] - send
    assert r["e2e_s"] == times[-1] - send
    assert r["itl_s"] == [b - a for a, b in zip(times, times[1:])] and len(r["itl_s"]) == chunks - 1
    n = r["output_tokens"]
    assert r["tpot_s"] == ((r["e2e_s"] - r["ttft_s"]) / (n - 1) if n > 1 else None)
    assert r["ttft_s"] >= FIRST_DELAY_S


def test_all_requests_complete_with_exact_metrics(start_stub):
    url, stub = start_stub(chunks=4, tokens_per_chunk=2)
    out = bench(url + "/v1", "stub-model", _requests(8), progress=False)
    s, records = out["summary"], out["requests"]
    assert (s["completed"], s["failed"], len(records)) == (8, 0, 8)
    assert [r["index"] for r in records] == list(range(8))
    for r in records:
        assert r["success"] and r["error"] is None
        assert (r["output_tokens"], r["output_tokens_source"], r["input_tokens"]) == (8, "usage", 7)
        _check_record(r, chunks=4)
    assert all(b["max_tokens"] == 8 and b["temperature"] == 0 and "ignore_eos" not in b for b in stub.bodies)
    assert s["total_output_tokens"] == 64 and s["total_prompt_tokens"] == 56
    assert s["request_throughput_req_s"] == 8 / s["duration_s"] and s["output_throughput_tok_s"] == 64 / s["duration_s"]
    assert s["goodput_req_s"] is None


def test_summary_percentiles_equal_numpys(start_stub):
    url, _ = start_stub(chunks=5)
    out = bench(url, "stub-model", _requests(6), progress=False)
    s, records = out["summary"], out["requests"]
    values = {"ttft": [r["ttft_s"] for r in records], "tpot": [r["tpot_s"] for r in records],
              "e2e": [r["e2e_s"] for r in records], "itl": [g for r in records for g in r["itl_s"]]}
    assert len(values["itl"]) == 6 * 4
    for name, v in values.items():
        assert s[f"{name}_mean_s"] == float(np.mean(v))
        for p in (50, 90, 99):  # vLLM's percentiles, the engine summary's
            assert s[f"{name}_p{p}_s"] == float(np.percentile(v, p))


def test_no_usage_counts_chunks_and_chat_skips_role_chunk(start_stub):
    url, stub = start_stub(chunks=3, usage=False)
    for endpoint in ("completions", "chat"):
        out = bench(url, "stub-model", _requests(3), endpoint=endpoint, ignore_eos=True, progress=False)
        for r in out["requests"]:
            assert (r["output_tokens"], r["output_tokens_source"]) == (3, "chunks")
            assert r["input_tokens"] == r["prompt_len"] == 3
            _check_record(r, chunks=3)
    assert any("messages" in b for b in stub.bodies) and all(b["ignore_eos"] is True for b in stub.bodies)


def test_failures_are_counted_not_dropped(start_stub):
    url, _ = start_stub(chunks=2, fail_marker="FAIL")
    out = bench(url, "stub-model", _requests(9, fail_every=3), progress=False)
    s, records = out["summary"], out["requests"]
    assert (s["completed"], s["failed"], len(records)) == (6, 3, 9)
    for r in records:
        failed = r["index"] % 3 == 0
        assert r["success"] is not failed
        if failed:
            assert "500" in r["error"] and r["ttft_s"] is None and r["chunk_times_s"] == []
    assert s["ttft_p99_s"] == float(np.percentile([r["ttft_s"] for r in records if r["success"]], 99))


def test_unreachable_server_and_timeout_are_recorded(start_stub):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    out = bench(f"http://127.0.0.1:{port}", "m", _requests(2), progress=False, timeout_s=5)
    assert out["summary"]["failed"] == 2 and all("Connection" in r["error"] for r in out["requests"])
    with pytest.raises(ValueError, match="--base-url"):
        first_model_id(f"http://127.0.0.1:{port}")
    url, _ = start_stub(chunks=2, first_delay_s=1.0)
    out = bench(url, "stub-model", _requests(2), progress=False, timeout_s=0.2)
    assert out["summary"]["failed"] == 2 and all("timed out" in r["error"] for r in out["requests"])


@pytest.mark.parametrize("finish_reason, error", [(None, "ended without a finish_reason after 3 text chunks"),
                                                  ("", "ended without a finish_reason after 3 text chunks"),
                                                  ("abort", "the server aborted it (finish_reason 'abort')")])
def test_a_stream_cut_short_or_aborted_is_a_failure(start_stub, finish_reason, error):
    """A drain's aborted requests and a stream that stops without finishing were counted as successes, their
    shortened E2E among the latencies."""
    url, _ = start_stub(chunks=3, finish_reason=finish_reason)
    out = bench(url, "stub-model", _requests(2), progress=False)
    assert out["summary"]["failed"] == 2 and all(error in r["error"] for r in out["requests"])
    assert out["summary"]["e2e_p50_s"] is None


@pytest.mark.parametrize("claimed", ["abc", -5, 3.5, True, 1000, 2])
def test_a_usage_that_cannot_be_true_is_not_taken(start_stub, claimed):
    """One bad usage value crashed the whole run (a str), or made throughput negative and TPOT tiny: a count
    that is not an int from the text chunks (4) to max_tokens (8) is set aside, and the chunks are counted."""
    url, _ = start_stub(chunks=4, usage_tokens=claimed)
    out = bench(url, "stub-model", _requests(2), progress=False)
    s = out["summary"]
    assert s["completed"] == 2 and s["num_usage_not_taken"] == 2 and s["total_output_tokens"] == 8
    assert all(r["output_tokens_source"] == "chunks" and "completion_tokens" in r["usage_error"]
               for r in out["requests"])


def test_more_text_chunks_than_max_tokens_is_a_failure(start_stub):
    url, _ = start_stub(chunks=5)
    out = bench(url, "stub-model", _requests(2, output_len=3), progress=False)
    assert out["summary"]["failed"] == 2 and "5 text chunks for max_tokens 3" in out["requests"][0]["error"]


def test_a_connection_error_names_its_cause_and_a_week_of_sends_is_refused():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = bench(f"http://127.0.0.1:{port}", "m", _requests(1), progress=False, timeout_s=5)
    assert "APIConnectionError: Connection error. (ConnectError" in out["requests"][0]["error"]
    with pytest.raises(ValueError, match=r"--rate 1e-06: 2 requests at 1e-06/s take about 1e\+06 s to send"):
        bench("http://127.0.0.1:1", "m", _requests(2), rate=1e-6, progress=False)


def test_an_interrupted_run_keeps_the_requests_that_finished(start_stub):
    """Ctrl-C (the run's task cancelled) threw every finished request away; now they are the result, marked."""
    from minibatch.serving.bench import benchmark

    url, _ = start_stub(chunks=2)

    async def interrupted():
        task = asyncio.ensure_future(benchmark(url, "stub-model", _requests(20), max_concurrency=1, progress=False))
        await asyncio.sleep(0.5)  # a request takes ~0.07 s: some finished, most not
        task.cancel()
        return await task

    out = asyncio.run(interrupted())
    n = len(out["requests"])
    assert out["interrupted"] is True and 1 <= n < 20 and out["summary"]["completed"] == n
    assert [r["index"] for r in out["requests"]] == list(range(n))


def test_a_busy_client_is_measured_and_named(start_stub, monkeypatch):
    """A client too busy for its streams stamps their chunks late (a thousand streams at once on 2 cores read TTFT
    seconds later than the server sent it): its event loop's lag is in the summary, and over 50 ms it is a warning."""
    from minibatch.serving import bench_stats

    url, _ = start_stub(chunks=2)
    calm = bench(url, "stub-model", _requests(2), progress=False)["summary"]
    assert 0 <= calm["client_lag_p99_s"] <= calm["client_lag_max_s"] < 0.15  # (a busy CI machine stalls too)
    finish = bench_stats.finish_record

    def busy(record):  # the loop's thread held for 0.2 s, as by parsing a thousand streams
        time.sleep(0.2)
        return finish(record)

    monkeypatch.setattr(bench_mod, "finish_record", busy)
    summary = bench(url, "stub-model", _requests(2), progress=False)["summary"]
    assert summary["client_lag_max_s"] >= 0.15
    assert "the client's event loop ran up to" in bench_stats.lag_warning(summary)
    assert bench_stats.lag_summary([0.0] * 99 + [1.0]) == {"client_lag_p99_s": pytest.approx(0.01),
                                                           "client_lag_max_s": 1.0}


def test_goodput_counts_requests_meeting_every_slo(start_stub):
    url, _ = start_stub(chunks=3)
    out = bench(url, "stub-model", _requests(6), slo=SLO(ttft_s=FIRST_DELAY_S / 10), progress=False)
    # every TTFT >= the stub's delay
    assert out["summary"]["num_good_requests"] == 0 and out["summary"]["goodput_req_s"] == 0.0
    records, duration = out["requests"], out["summary"]["duration_s"]
    ttft = sorted(r["ttft_s"] for r in records)
    for slo in (SLO(ttft_s=ttft[2]), SLO(e2e_s=1000.0), SLO(ttft_s=ttft[3], tpot_s=1e-9), SLO(tpot_s=1000.0)):
        good = [r for r in records if all(limit is None or r[name] <= limit for name, limit in
                                          (("ttft_s", slo.ttft_s), ("tpot_s", slo.tpot_s), ("e2e_s", slo.e2e_s)))]
        s = summarize(records, duration, slo)
        assert s["num_good_requests"] == len(good) and s["goodput_req_s"] == len(good) / duration
    one_token = dict(records[0], success=True, output_tokens=1, tpot_s=None)  # vLLM: TPOT counts as 0
    assert summarize([one_token], 1.0, SLO(tpot_s=1e-9))["num_good_requests"] == 1


def test_bench_runs_inside_a_running_event_loop(start_stub):
    """A notebook cell runs in an event loop, where asyncio.run is refused: bench still works there."""
    url, _ = start_stub(chunks=2)

    async def cell():
        return bench(url, "stub-model", _requests(2), progress=False)

    assert asyncio.run(cell())["summary"]["completed"] == 2


def test_max_concurrency_bounds_open_requests(start_stub):
    url, stub = start_stub(chunks=3)
    out = bench(url, "stub-model", _requests(6), max_concurrency=2, progress=False)
    assert out["summary"]["completed"] == 6
    assert 1 <= stub.max_open <= 2


def _pairs() -> list[tuple[str, str]]:
    """ShareGPT-like (human, gpt) pairs; the tiny tokenizer counts one token per byte."""
    pairs = [(f"question number {i}?", "answer " * (i % 5)) for i in range(40)]
    return pairs + [("", "empty prompt"), ("   ", "blank prompt"), ("empty reply", ""), ("x" * 500, "too long")]


def test_sample_requests_filters_clips_and_is_seeded():
    tok = tiny_tokenizer()
    reqs = sample_requests(20, 0, tok, max_prompt_len=64, max_output_len=20, pairs=_pairs())
    assert len(reqs) == 20 and reqs == sample_requests(20, 0, tok, 64, 20, pairs=_pairs())
    assert reqs != sample_requests(20, 1, tok, 64, 20, pairs=_pairs())
    by_prompt = dict(_pairs())
    for r in reqs:
        assert r.prompt.strip() and r.prompt_len == len(tok(r.prompt).input_ids) <= 64
        assert r.output_len == min(max(len(tok(by_prompt[r.prompt]).input_ids), 1), 20)
    assert {r.output_len for r in reqs} <= {7, 14, 20}  # replies of 7, 14, 21, 28 bytes, clipped to 20
    assert all(r.output_len == 5 for r in sample_requests(10, 0, tok, 64, 20, output_len=5, pairs=_pairs()))
    with pytest.raises(ValueError, match="--num-prompts"):
        sample_requests(33, 0, tok, 64, 20, pairs=_pairs())  # 32 pairs fit


def _parse(*argv: str) -> argparse.Namespace:
    return add_bench_serve_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_cli_path_writes_json(start_stub, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(bench_mod, "human_gpt_pairs", lambda: (_pairs(), len(_pairs())))
    url, stub = start_stub(chunks=2)
    path = tmp_path / "out" / "bench.json"
    args = _parse("--base-url", url + "/", "--tokenizer", "tiny-random-llama", "--num-prompts", "5", "--seed", "3",
                  "--max-output-len", "6", "--slo-ttft-s", "100", "--json", str(path), "--no-progress",
                  "--num-warmups", "0")
    result = run_bench_serve(args, command="python -m minibatch bench-serve ...")
    saved = json.loads(path.read_text())
    assert saved["command"] == "python -m minibatch bench-serve ..." and saved["environment"]["python"]
    assert saved["model"] == result["model"] == "stub-model"  # asked from GET /v1/models
    assert saved["base_url"] == url + "/v1" and saved["config"]["rate"] == "inf"
    assert saved["summary"]["completed"] == 5 and saved["summary"]["num_good_requests"] == 5
    assert saved["requests"] == json.loads(json.dumps(result["requests"]))
    expected = sample_requests(5, 3, tiny_tokenizer(), 256, 6, pairs=_pairs())
    assert sorted(b["max_tokens"] for b in stub.bodies) == sorted(r.output_len for r in expected)
    assert "TTFT" in capsys.readouterr().out
    stub.fail_marker = "?"  # every question fails: the run is an error, and the earlier result is left as it was
    with pytest.raises(ValueError, match="all 5 requests failed; the first: .*stub failure"):
        run_bench_serve(args)
    assert json.loads(path.read_text())["summary"]["completed"] == 5
    assert f"left {path} as it was" in capsys.readouterr().out
    path.unlink()  # with no earlier result, the failed run's JSON says why
    with pytest.raises(ValueError, match="all 5 requests failed"):
        run_bench_serve(args)
    assert json.loads(path.read_text())["summary"]["failed"] == 5


def test_warm_ups_are_sent_first_and_not_measured(start_stub, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(bench_mod, "human_gpt_pairs", lambda: (_pairs(), len(_pairs())))
    url, stub = start_stub(chunks=2)
    path = tmp_path / "bench.json"
    argv = ["--base-url", url, "--tokenizer", "tiny-random-llama", "--num-prompts", "4", "--json", str(path),
            "--no-progress"]
    result = run_bench_serve(_parse(*argv, "--num-warmups", "3"))  # (the CLI's default is 1)
    warm, measured = stub.bodies[:3], stub.bodies[3:]  # three copies of request 0, then the 4 measured requests
    assert len(measured) == 4 and warm == [warm[0]] * 3 and warm[0] in measured
    assert [r["index"] for r in result["requests"]] == [0, 1, 2, 3] and result["summary"]["completed"] == 4
    assert min(r["send_time_s"] for r in result["requests"]) < FIRST_DELAY_S  # the clock starts after the warm-ups
    assert result["config"]["num_warmups"] == 3 and _parse("--base-url", url).num_warmups == 1
    stub.max_open, bodies = 0, len(stub.bodies)  # warm-ups keep to --max-concurrency, as the requests do
    bench(url, "stub-model", _requests(2), num_warmups=5, max_concurrency=2, progress=False)
    assert len(stub.bodies) == bodies + 5 + 2 and stub.max_open == 2
    stub.fail_marker = "prompt 0"  # the library call: request 0 is the warm-up, so its failure stops the run
    with pytest.raises(ValueError, match=r"--num-warmups: 2 of 2 warm-up requests failed, the first: .*stub failure"):
        bench(url, "stub-model", _requests(3), num_warmups=2, progress=False)
    stub.fail_marker, bodies = "?", len(stub.bodies)  # a failed warm-up leaves the earlier result as it was
    with pytest.raises(ValueError, match="--num-warmups: 1 of 1 warm-up requests failed"):
        run_bench_serve(_parse(*argv))
    assert len(stub.bodies) == bodies + 1 and json.loads(path.read_text())["summary"]["completed"] == 4


@pytest.mark.parametrize("argv, option", [
    (["--num-warmups", "-1"], "--num-warmups"),
    (["--seed", "-1"], "--seed"), (["--output-len", "1000000000000"], "--output-len"),
    (["--rate", "0"], "--rate"), (["--rate", "-2"], "--rate"), (["--rate", "nan"], "--rate"),
    (["--num-prompts", "0"], "--num-prompts"), (["--burstiness", "0"], "--burstiness"),
    (["--max-concurrency", "0"], "--max-concurrency"), (["--max-prompt-len", "0"], "--max-prompt-len"),
    (["--max-output-len", "0"], "--max-output-len"), (["--output-len", "0"], "--output-len"),
    (["--slo-ttft-s", "0"], "--slo-ttft-s"), (["--slo-tpot-s", "-1"], "--slo-tpot-s"),
    (["--slo-e2e-s", "inf"], "--slo-e2e-s"), (["--timeout-s", "0"], "--timeout-s"),
    # upper bounds and empty names (each was accepted silently)
    (["--rate", "1e9"], "--rate"), (["--burstiness", "1e9"], "--burstiness"), (["--timeout-s", "1e12"], "--timeout-s"),
    (["--slo-tpot-s", "1e12"], "--slo-tpot-s"), (["--max-concurrency", "10000000"], "--max-concurrency"),
    (["--num-prompts", "10000000"], "--num-prompts"), (["--model", ""], "--model"),
    (["--tokenizer", " "], "--tokenizer"), (["--json", ""], "--json"),
])
def test_bad_options_raise_value_error_naming_the_option(argv, option):
    with pytest.raises(ValueError, match=option) as e:  # checked before any connection is tried
        run_bench_serve(_parse("--base-url", "http://127.0.0.1:9", *argv))
    assert "\n" not in str(e.value)


def test_library_checks_options():
    with pytest.raises(ValueError, match="--endpoint"):
        bench("http://127.0.0.1:9", "m", _requests(1), endpoint="embeddings")
    with pytest.raises(ValueError, match="--num-prompts"):
        bench("http://127.0.0.1:9", "m", [])


def test_arrival_offsets():
    assert arrival_offsets(4) == [0.0] * 4
    t = arrival_offsets(20000, rate=50.0, burstiness=0.5, seed=1)
    assert t[0] == 0.0 and t == arrival_offsets(20000, rate=50.0, burstiness=0.5, seed=1)
    gaps = np.diff(t)
    assert (gaps >= 0).all() and math.isclose(gaps.mean(), 1 / 50, rel_tol=0.05)
    assert math.isclose(gaps.std() / gaps.mean(), 1 / math.sqrt(0.5), rel_tol=0.05)  # gamma CV = 1/sqrt(shape)


def test_helpers():
    assert api_base("http://h:8000") == api_base("http://h:8000/v1/") == "http://h:8000/v1"
    assert default_tokenizer_name("tiny-random-llama") == "tiny-random-llama"
    assert default_tokenizer_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m"


def test_modules_stay_short():
    folder = Path(bench_mod.__file__).parent
    for name in ("bench.py", "bench_stats.py"):
        assert len((folder / name).read_text().splitlines()) <= 300


@pytest.fixture
def extra_column():
    """A metric registered in one place (minibatch.metrics.register_column), removed afterwards."""
    from minibatch.metrics import COLUMNS, register_column

    register_column("ttft_p75_s", "s", lambda s: float(np.percentile(s.latency("ttft"), 75)) if s.metrics else None,
                    header="TTFT p75 s")
    yield
    COLUMNS.pop("ttft_p75_s")


def test_a_new_metric_column_appears_in_compare_and_bench_serve(extra_column, start_stub, tmp_path: Path,
                                                                 monkeypatch, capsys, one_thread):
    from minibatch.__main__ import main

    main(["compare", "--dtype", "float32", "--model", "tiny-random-llama", "--num-requests", "4", "--clock", "sim",
          "--policies", "paged", "--max-output-len", "8", "--figures-dir", "", "--no-progress", "--no-reference",
          "--json", str(tmp_path / "compare.json")])
    row = json.loads((tmp_path / "compare.json").read_text())["policies"]["paged"]
    assert row["ttft_p75_s"] is not None and row["ttft_p50_s"] <= row["ttft_p75_s"] <= row["ttft_p99_s"]
    assert "TTFT p75 s" in capsys.readouterr().out  # compare's table

    monkeypatch.setattr(bench_mod, "human_gpt_pairs", lambda: (_pairs(), len(_pairs())))
    url, _ = start_stub(chunks=2)
    args = _parse("--base-url", url, "--tokenizer", "tiny-random-llama", "--num-prompts", "5",
                  "--json", str(tmp_path / "bench.json"), "--no-progress")
    run_bench_serve(args, command="python -m minibatch bench-serve ...")
    saved = json.loads((tmp_path / "bench.json").read_text())
    ttft = [r["ttft_s"] for r in saved["requests"]]
    assert saved["summary"]["ttft_p75_s"] == float(np.percentile(ttft, 75))
    assert "TTFT p75 s" in capsys.readouterr().out  # bench-serve's table
