"""AsyncEngine without a model (SimExecutor on a LiveClock): streams end with their finish_reason,
a step loop that dies ends every open stream with EngineDeadError and makes /health answer 503,
and shutdown ends open streams with "abort"."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from minibatch.clock import LiveClock
from minibatch.policies import make_engine
from minibatch.request import Request, SamplingParams
from minibatch.serving.async_engine import AsyncEngine, EngineDeadError, TokenDelta
from minibatch.serving.metrics import ServingMetrics
from minibatch.serving.server import build_app
from minibatch.sim.executor import SimExecutor

GREEDY = SamplingParams(ignore_eos=True)


def request(rid: str, max_new_tokens: int = 5) -> Request:
    return Request(rid, [3] * 6, max_new_tokens, GREEDY)


async def drain(stream) -> list[TokenDelta]:
    return [delta async for delta in stream]


async def generated(async_engine: AsyncEngine, r: Request) -> list[TokenDelta]:
    """Every TokenDelta of ``r``, submitted from a running event loop."""
    return await drain(async_engine.submit(r))


async def submit(async_engine: AsyncEngine, r: Request):
    """``async_engine.submit(r)`` from a running event loop (what it needs)."""
    return async_engine.submit(r)


async def wait_for(condition, timeout_s: float = 30.0) -> None:
    """Poll ``condition()`` every 5 ms until it holds; fail after ``timeout_s``."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), timeout_s)


def test_a_stream_yields_every_token_then_its_finish_reason():
    async_engine = AsyncEngine(make_engine("paged", SimExecutor(), LiveClock(), n_slots=256, block_size=4)).start()
    try:
        deltas = asyncio.run(generated(async_engine, request("a", 7)))
    finally:
        async_engine.shutdown()
    assert sum(len(d.token_ids) for d in deltas) == 7
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]


def test_a_step_that_raises_ends_open_streams_and_health_answers_503(monkeypatch):
    engine = make_engine("paged", SimExecutor(), LiveClock(), n_slots=256, block_size=4)

    def broken_step():
        raise RuntimeError("boom in step")

    monkeypatch.setattr(engine, "step", broken_step)  # an instance attribute shadows Engine.step
    async_engine = AsyncEngine(engine).start()
    with pytest.raises(EngineDeadError, match="boom in step"):
        asyncio.run(generated(async_engine, request("a")))
    async_engine.shutdown()
    assert not async_engine.is_alive and isinstance(async_engine.error, RuntimeError)
    with pytest.raises(EngineDeadError, match="boom in step"):
        asyncio.run(submit(async_engine, request("b")))
    client = TestClient(build_app(async_engine, None, "sim", ServingMetrics("sim")))
    r = client.get("/health")
    assert r.status_code == 503 and "boom in step" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "sim", "prompt": [1, 2, 3], "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_a_request_in_flight_when_the_step_raises_gets_a_503_error_object(monkeypatch):
    engine = make_engine("paged", SimExecutor(), LiveClock(), n_slots=256, block_size=4)

    def broken_step():
        raise RuntimeError("boom in step")

    monkeypatch.setattr(engine, "step", broken_step)
    async_engine = AsyncEngine(engine).start()  # alive until its first step, which the request below starts
    client = TestClient(build_app(async_engine, None, "sim", ServingMetrics("sim")))
    r = client.post("/v1/completions", json={"model": "sim", "prompt": [1, 2, 3], "max_tokens": 4})
    async_engine.shutdown()
    error = r.json()["error"]
    assert r.status_code == 503 and error["type"] == "server_error" and "boom in step" in error["message"]
    assert "EngineDeadError" not in error["message"]


def test_shutdown_ends_open_streams_with_abort():
    # a static batch of 4 waits up to 600 s to fill: the one request stays waiting until shutdown
    engine = make_engine("static", SimExecutor(), LiveClock(), batch_size=4, max_wait_s=600.0)
    async_engine = AsyncEngine(engine).start()

    async def run():
        stream = async_engine.submit(request("a"))
        await wait_for(lambda: any(r.request_id == "a" for r in engine.scheduler.waiting))
        async_engine.shutdown()
        return await drain(stream)

    assert asyncio.run(run()) == [TokenDelta((), "abort")]
    assert not async_engine.is_alive and async_engine.error is None
    with pytest.raises(EngineDeadError, match="not running"):
        asyncio.run(submit(async_engine, request("b")))
