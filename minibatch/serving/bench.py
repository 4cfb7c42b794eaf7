"""``bench-serve``: a client-side load generator for ANY OpenAI-compatible server, in the form of vLLM's
serving benchmark.

ShareGPT prompts (:func:`sample_requests`) are sent with streaming ``/v1/completions`` (or
``/v1/chat/completions``) through the official ``openai`` client, arriving at ``--rate`` requests/s
(gamma gaps, ``--burstiness``; inf = all at once) with at most ``--max-concurrency`` open. Every text
chunk's arrival is stamped with ``time.perf_counter`` (seconds after the run's start); TTFT, ITL,
TPOT, E2E, throughput and goodput under ``--slo-*`` follow (:mod:`minibatch.serving.bench_stats`).
A failed request (HTTP or connection error, timeout) is recorded with its error, never dropped.

Library use (a notebook): ``bench(base_url, model, requests, rate=4.0)``; the CLI: :func:`run_bench_serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from openai import AsyncOpenAI

from minibatch.machine import raise_fd_limit
from minibatch.metrics import SLO
from minibatch.serving.text import load_tokenizer  # (bench-serve's tokenizer: here too, for notebooks)
from minibatch.serving.bench_stats import (DEFAULT_BURSTINESS, DEFAULT_MAX_OUTPUT_LEN, ENDPOINTS, api_base,
                                           arrival_offsets, check_args, check_options, chunk_text,
                                           default_tokenizer_name, error_text, finish_record, format_summary,
                                           lag_summary, lag_warning, summarize, LAG_TICK_S)
from minibatch.sharegpt import human_gpt_pairs


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: prompt text, its length in tokens, and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    output_len: int


def sample_requests(num_prompts: int, seed: int, tokenizer, max_prompt_len: int = 256, max_output_len: int = 128,
                    output_len: int | None = None, pairs: list[tuple[str, str]] | None = None) -> list[BenchRequest]:
    """``num_prompts`` requests from ShareGPT first turns (``pairs``: default ``human_gpt_pairs()``), as vLLM does.

    Pairs are shuffled with ``numpy.random.default_rng(seed)``; a pair is kept when both texts are
    non-empty and the prompt has at most ``max_prompt_len`` tokens (``tokenizer(prompt).input_ids``).
    output_len is ``output_len`` if given, else the reply's token count clipped to [1, max_output_len].

    Raises:
        ValueError: fewer than ``num_prompts`` pairs fit (names --num-prompts and --max-prompt-len).
    """
    from minibatch.hf_load import quiet_loading  # long replies make tokenizers warn about model length

    pairs = human_gpt_pairs()[0] if pairs is None else pairs
    chosen: list[BenchRequest] = []
    with quiet_loading():
        for i in np.random.default_rng(seed).permutation(len(pairs)).tolist():
            prompt, reply = pairs[i]
            if not prompt.strip() or not reply.strip():
                continue
            prompt_len = len(tokenizer(prompt).input_ids)
            if prompt_len > max_prompt_len:
                continue
            n = output_len if output_len is not None else min(max(len(tokenizer(reply).input_ids), 1), max_output_len)
            chosen.append(BenchRequest(prompt, prompt_len, n))
            if len(chosen) == num_prompts:
                return chosen
    raise ValueError(f"--num-prompts {num_prompts}: only {len(chosen)} ShareGPT prompts have at most "
                     f"--max-prompt-len {max_prompt_len} tokens")


def first_model_id(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id the server lists at ``GET /v1/models``.

    Raises:
        ValueError: the server cannot be reached or lists no model (names --base-url / --model).
    """
    from openai import OpenAI  # here, not at the top: the command line builds its parser without the client

    try:
        with OpenAI(base_url=api_base(base_url), api_key="EMPTY", timeout=timeout_s, max_retries=0) as client:
            ids = [m.id for m in client.models.list()]
    except Exception as e:  # connection refused, HTTP error, not an OpenAI-compatible answer
        raise ValueError(f"--base-url: cannot list models at {api_base(base_url)}/models ({type(e).__name__}: "
                         f"{e}); is the server up? (or give --model)") from e
    if not ids:
        raise ValueError(f"--model: the server at {api_base(base_url)} lists no model; give --model")
    return ids[0]


def _open_stream(client: AsyncOpenAI, model: str, request: BenchRequest, endpoint: str, ignore_eos: bool):
    """The create() call of one streamed request (a coroutine giving the stream)."""
    common = dict(model=model, max_tokens=request.output_len, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True} if ignore_eos else None)
    if endpoint == "chat":
        return client.chat.completions.create(messages=[{"role": "user", "content": request.prompt}], **common)
    return client.completions.create(prompt=request.prompt, **common)


async def _stream_into(record: dict, client: AsyncOpenAI, model: str, request: BenchRequest, endpoint: str,
                       ignore_eos: bool, t0: float) -> None:
    """Send one request and stamp every text chunk's arrival into ``record`` (seconds after ``t0``)."""
    pieces: list[str] = []
    try:
        async with await _open_stream(client, model, request, endpoint, ignore_eos) as stream:
            async for chunk in stream:
                now = time.perf_counter() - t0
                text, finish_reason = chunk_text(chunk, endpoint)
                if text:
                    record["chunk_times_s"].append(now)
                    pieces.append(text)
                if finish_reason:  # ('' and None: not finished)
                    record["finish_reason"] = finish_reason
                if chunk.usage is not None:
                    record["prompt_tokens"] = chunk.usage.prompt_tokens
                    record["completion_tokens"] = chunk.usage.completion_tokens
    finally:
        record["text"] = "".join(pieces)


async def _run_request(index: int, request: BenchRequest, client: AsyncOpenAI, model: str, endpoint: str,
                       ignore_eos: bool, t0: float, timeout_s: float) -> dict:
    """One request's finished record; errors (HTTP, connection, timeout, ``stream_problem``s) are recorded."""
    record = {"index": index, "prompt_len": request.prompt_len, "output_len": request.output_len,
              "success": False, "error": None, "send_time_s": time.perf_counter() - t0, "chunk_times_s": [],
              "finish_reason": None, "prompt_tokens": None, "completion_tokens": None}
    try:
        await asyncio.wait_for(_stream_into(record, client, model, request, endpoint, ignore_eos, t0), timeout_s)
    except asyncio.TimeoutError:
        record["error"] = f"timed out after {timeout_s} s (--timeout-s)"
    except Exception as e:  # openai.APIStatusError, APIConnectionError, a malformed stream, ...
        record["error"] = error_text(e)
    else:
        record["success"] = True  # an empty completion (EOS first) is an answer: no latencies, 0 or 1 tokens
    return finish_record(record)


async def benchmark(base_url: str, model: str, requests: list[BenchRequest], *, rate: float = math.inf,
                    burstiness: float = 1.0, max_concurrency: int | None = None, endpoint: str = "completions",
                    ignore_eos: bool = False, slo: SLO | None = None, seed: int = 0, progress: bool = True,
                    timeout_s: float = 600.0, num_warmups: int = 0) -> dict:
    """Send ``requests`` to the server at ``base_url``; ``{"summary": ..., "requests": [records]}``, and
    ``"interrupted": True`` with the requests finished so far when the run is cancelled (Ctrl-C; Python 3.11+).

    Request i is sent ``arrival_offsets(...)[i]`` seconds after the start, once one of the ``max_concurrency`` slots
    is free (vLLM's semaphore: its send time is stamped after the wait), on a connection of its own. Before the
    clock starts, ``num_warmups`` copies of request 0 are sent (at most ``max_concurrency`` open) and not measured
    (vLLM's ``--num-warmups``): they take the client's and the server's first-request costs out of the first wave's
    TTFT.

    Raises:
        ValueError: a bad option (see :func:`check_options`), or a warm-up request that failed (its error).
    """
    check_options(len(requests), rate, burstiness, max_concurrency, endpoint, timeout_s, num_warmups)
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def watch() -> None:  # how late the client's own event loop runs: its chunk stamps are late as much
        while True:
            t = time.perf_counter()
            await asyncio.sleep(LAG_TICK_S)
            lags.append(time.perf_counter() - t - LAG_TICK_S)

    async def send(index: int, request: BenchRequest) -> dict:
        await asyncio.sleep(max(0.0, t0 + offsets[index] - time.perf_counter()))
        async with slots:
            record = await _run_request(index, request, client, model, endpoint, ignore_eos, t0, timeout_s)
        bar.update(1)
        finished.append(record)
        return record

    async def warm_up() -> dict:  # a copy of request 0, unmeasured, under the same --max-concurrency (as vLLM's)
        async with slots:
            return await _run_request(-1, requests[0], client, model, endpoint, ignore_eos, 0.0, timeout_s)

    import httpx
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    raise_fd_limit()  # a connection per open request (a pool of 1000 made request 1001 wait, inside its TTFT)
    pool = DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=100))
    async with AsyncOpenAI(base_url=api_base(base_url), api_key="EMPTY", timeout=timeout_s, max_retries=0,
                           http_client=pool) as client:
        warm = await asyncio.gather(*(warm_up() for _ in range(num_warmups)))
        if failed := [w["error"] for w in warm if not w["success"]]:
            raise ValueError(f"--num-warmups: {len(failed)} of {num_warmups} warm-up requests failed, the first: "
                             f"{failed[0]} (--num-warmups 0 skips the warm-up)")
        bar = tqdm(total=len(requests), desc="bench-serve", unit="req", disable=not progress)  # (after the warm-ups)
        t0, finished, lags = time.perf_counter(), [], []
        watcher = asyncio.ensure_future(watch())
        try:
            records, cut = await asyncio.gather(*(send(i, r) for i, r in enumerate(requests))), {}
        except asyncio.CancelledError:  # Ctrl-C: the requests that finished are kept, the run marked interrupted
            records, cut = sorted(finished, key=lambda r: r["index"]), {"interrupted": True}
        finally:
            watcher.cancel()
        duration_s = time.perf_counter() - t0
    bar.close()
    return {"summary": summarize(records, duration_s, slo) | lag_summary(lags), "requests": records} | cut


def bench(base_url: str, model: str, requests: list[BenchRequest], **options) -> dict:
    """:func:`benchmark` run to completion (``asyncio.run``): the call for scripts and notebooks. Inside a
    running event loop (a Jupyter cell) ``asyncio.run`` is refused, so it then runs in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop running: the usual case
        return asyncio.run(benchmark(base_url, model, requests, **options))
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, benchmark(base_url, model, requests, **options)).result()


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench-serve`` options to ``parser`` (returned)."""
    a = parser.add_argument
    a("--base-url", required=True, help="the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1 (/v1 optional)")
    a("--model", default=None, help="model name to send (default: the first id at GET /v1/models)")
    a("--tokenizer", default=None, help="tokenizer to count tokens: one of our model names, a local dir or hub id "
                                        "(default: --model if it is one of our model names, else smollm2-135m)")
    a("--endpoint", default="completions", choices=ENDPOINTS, help="/v1/completions or /v1/chat/completions")
    a("--num-prompts", type=int, default=50, help="requests to send (ShareGPT prompts)")
    a("--rate", type=float, default=math.inf, help="mean requests/s (default inf: all at once)")
    a("--burstiness", type=float, default=DEFAULT_BURSTINESS, help="gamma shape of the arrival gaps (1.0 = Poisson)")
    a("--max-concurrency", type=int, default=None, help="at most this many requests open (default: unbounded)")
    a("--seed", type=int, default=0, help="seed of the prompt sample and the arrival gaps")
    a("--max-prompt-len", type=int, default=256, help="keep prompts of at most this many tokens")
    a("--max-output-len", type=int, default=DEFAULT_MAX_OUTPUT_LEN,
      help="clip the ShareGPT reply length to this many tokens (not with --output-len)")
    a("--output-len", type=int, default=None, help="ask every request for exactly this many tokens instead")
    a("--ignore-eos", action="store_true", help="send ignore_eos=true (vLLM and our server know it)")
    for name in ("ttft", "tpot", "e2e"):
        a(f"--slo-{name}-s", type=float, default=None, help=f"{name.upper()} objective in seconds, for goodput")
    a("--json", default=None, metavar="PATH", help="write the result (command, environment, summary, requests)")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--timeout-s", type=float, default=600.0, help="per-request time limit in seconds")
    a("--num-warmups", type=int, default=1, help="copies of the first request sent, unmeasured, before the clock "
                                                  "starts; one that fails stops the run (0: none)")
    return parser


def run_bench_serve(args: argparse.Namespace, command: str | None = None) -> dict:
    """The whole ``bench-serve`` job: check options, pick model and tokenizer, sample, run, print, save.

    ``command`` is stored as the result's command line (default: ``python -m minibatch`` + argv).
    Returns {"command", "environment", "base_url", "model", "config", "summary", "requests"}.

    Raises:
        ValueError: a bad option, an unreachable server, a tokenizer that does not load (names the option).
    """
    from minibatch.files import check_output_file, write_json
    from minibatch.report import environment, machine_load

    slo = check_args(args)
    if args.json:
        check_output_file(args.json, "--json")
    model = args.model or first_model_id(args.base_url, min(args.timeout_s, 30.0))
    tokenizer_name = args.tokenizer or default_tokenizer_name(model)
    load_before = machine_load()  # how busy the client's machine was: recorded before and after
    tokenizer = load_tokenizer(tokenizer_name)
    requests = sample_requests(args.num_prompts, args.seed, tokenizer, args.max_prompt_len, args.max_output_len,
                               args.output_len)
    out = bench(args.base_url, model, requests, rate=args.rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, endpoint=args.endpoint, ignore_eos=args.ignore_eos, slo=slo,
                seed=args.seed, progress=not args.no_progress, timeout_s=args.timeout_s, num_warmups=args.num_warmups)
    config = {k: v for k, v in vars(args).items() if not callable(v)} | {"model": model, "tokenizer": tokenizer_name,
              "slo": asdict(slo) if slo else None, "rate": args.rate if math.isfinite(args.rate) else "inf"}
    result = {"command": command or " ".join(["python -m minibatch"] + sys.argv[1:]),
              "environment": environment(load_before), "base_url": api_base(args.base_url), "model": model,
              "config": config, **out}
    print(format_summary(out["summary"]))
    if warning := lag_warning(out["summary"]):
        print(f"warning: {warning}")
    measured = out["summary"]["completed"] - out["summary"]["num_empty"]  # requests that streamed text
    if args.json and (measured or not Path(args.json).exists()):  # (a run of nothing leaves an earlier one)
        write_json(args.json, result)
        print(f"wrote {args.json}")
    elif args.json:
        print(f"left {args.json} as it was: no request of this run streamed any text")
    if out.get("interrupted"):  # (what finished is in the JSON)
        raise KeyboardInterrupt
    if requests and not out["summary"]["completed"]:  # nothing measured: the command failed (the JSON has why)
        raise ValueError(f"all {len(requests)} requests failed; the first: {out['requests'][0]['error']}")
    if requests and not measured:
        raise ValueError(f"none of the {len(requests)} requests streamed any text (the server answered each with "
                         "an empty completion): nothing was measured")
    return result
