"""An OpenAI-compatible HTTP server on the engine (FastAPI): /v1/completions and
/v1/chat/completions (JSON or Server-Sent Events in OpenAI's chunk format), /v1/models, /health
and /metrics (Prometheus text). A client that disconnects aborts its request; a full waiting
queue answers 503 with Retry-After; a bad body answers 400 naming the field, a body over
``max_body_bytes`` 413; every error (unknown routes and methods too) is an OpenAI error object.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from concurrent.futures import ThreadPoolExecutor

import jinja2
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from minibatch.checks import MAX_ECHO_CHARS, short_repr
from minibatch.serving.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from minibatch.serving.connections import MAX_BODY_BYTES, read_body
from minibatch.serving.metrics import ServingMetrics
from minibatch.serving.protocol import (APIError, ChatCompletionRequest, CompletionRequest, Context,
                                        api_error_of, check_list_lengths, decode_json, make_request, one_prompt,
                                        parse_body)
from minibatch.serving.text import TextAssembler, template_role, template_tokens_per_message

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
# A body larger than BYTES_PER_TOKEN * max_model_len (at least MIN_SMALL_BODY_BYTES, at most SMALL_BODY_BYTES) is
# prepared in the large bodies' thread: English text runs about 4-5 bytes to a token, so most prompts that fill the
# context stay in the small lane (JSON-escaped non-ASCII text, or a list of large token ids, may not: it is served
# as well, in the other lane), and no body there costs much more to tokenize than such a prompt does.
BYTES_PER_TOKEN, MIN_SMALL_BODY_BYTES, SMALL_BODY_BYTES = 8, 16 << 10, 256 << 10


def build_app(engine: AsyncEngine, tokenizer, model_name: str, metrics: ServingMetrics,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving ``engine`` (started by the caller) as ``model_name``; a request body over
    ``max_body_bytes`` is refused with 413 before it is read whole."""
    # no redirect of '/v1/completions/' to '/v1/completions' (a 307 with an empty body): an unknown route is a 404
    # with an OpenAI error object, like any other
    app = FastAPI(title="minibatch", docs_url=None, redoc_url=None, redirect_slashes=False)
    # the context one request may use: the model's max_model_len, or less where the KV cache holds less
    context = Context(engine.engine.max_request_tokens(), engine.engine.executor.max_model_len)
    max_model_len = context.tokens
    app.state.engine, app.state.metrics, app.state.context = engine, metrics, context
    # The event loop does I/O only: decoding, validating, templating and tokenizing a body run in a thread, so a
    # huge body never stalls /health or streams; bodies over small_body_bytes in a lane of their own, with its own
    # copy of the tokenizer, so huge ones (even a valid prompt that takes a second to tokenize) never hold up a
    # normal request. Each copy encodes once now: its first call changes its settings (not while another runs).
    small_body_bytes = min(max(BYTES_PER_TOKEN * max_model_len, MIN_SMALL_BODY_BYTES), SMALL_BODY_BYTES)
    lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"minibatch-prepare-{n}") for n in ("small", "large")]
    tokenizers = [tokenizer, copy.deepcopy(tokenizer)]
    for t in tokenizers:
        if t is not None:  # (a test's app on a simulated engine has none)
            t.encode("warm up")
    message_tokens = template_tokens_per_message(tokenizer)  # a longer list of messages than fits is refused unread
    # a token's text is at most this many characters: a prompt of more than max_model_len times it cannot fit
    max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) if hasattr(tokenizer, "get_vocab") \
        else None

    def check_length(num_chars: int, field: str) -> None:
        """Refuse, before templating or tokenizing, a text that needs more tokens than the context holds."""
        if max_token_chars and num_chars > max_model_len * max_token_chars:
            raise APIError(f"{field}: {num_chars} characters cannot fit {context} (a token covers at most "
                           f"{max_token_chars} characters)", field)

    def prepare_completion(data: bytes, tok):
        body = decode_json(data, context)
        check_list_lengths(body, context)  # a huge list fails here, not after checking each item
        body = parse_body(CompletionRequest, body)
        prompt = one_prompt(body.prompt)
        if isinstance(prompt, str):
            check_length(len(prompt), "prompt")
            prompt = list(tok.encode(prompt))
        return body, prompt

    def prepare_chat(data: bytes, tok):
        body = decode_json(data, context)
        check_list_lengths(body, context, message_tokens)
        body = parse_body(ChatCompletionRequest, body)
        if not getattr(tok, "chat_template", None):
            raise APIError(f"messages: model {model_name!r} has no chat template; use /v1/completions", "messages")
        messages = [{"role": template_role(tok, m.role), "content": m.text()} | ({"name": m.name} if m.name else {})
                    for m in body.messages]
        check_length(sum(len(m["content"]) for m in messages), "messages")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError as e:  # the template's own raise_exception: roles or an order it does not take
            raise APIError(f"messages: the chat template refused them: {short_repr(str(e))}", "messages") from None
        return body, list(tok.encode(text, add_special_tokens=False))

    async def prepared(raw: HTTPRequest, prepare):
        data = await read_body(raw, max_body_bytes)
        lane = int(len(data) > small_body_bytes)
        return await asyncio.get_running_loop().run_in_executor(lanes[lane], prepare, data, tokenizers[lane])

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(raw: HTTPRequest, e: HTTPException):  # unknown route (404), wrong method (405)
        what = {404: "no such route", 405: "method not allowed"}.get(e.status_code, str(e.detail))
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        path = raw.url.path if len(raw.url.path) <= MAX_ECHO_CHARS else short_repr(raw.url.path)
        return JSONResponse(APIError(f"{what}: {raw.method} {path}", status=e.status_code, kind=kind).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(_, e: Exception):  # the server never dies on a request
        return JSONResponse(APIError(f"internal error: {e!r}", status=500, kind="server_error").body(), 500)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():  # 503 once draining too: a load balancer sends no more requests here
        if engine.draining:
            raise APIError("the server is shutting down (draining)", status=503, kind="server_error")
        if not engine.is_alive:
            raise APIError(f"the engine loop stopped: {engine.error!r}", status=503, kind="server_error")
        return {"status": "ok"}

    model_card = {"id": model_name, "object": "model", "created": 0, "owned_by": "minibatch",
                  "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):  # the openai client's models.retrieve
        if model_id != model_name:
            raise APIError(f"model: {short_repr(model_id)} is not served here; /v1/models lists {model_name!r}",
                           "model", status=404, kind="not_found_error")
        return model_card

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(raw: HTTPRequest):
        body, ids = await prepared(raw, prepare_completion)
        return await respond(raw, body, ids, max_new_tokens=body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: HTTPRequest):
        body, ids = await prepared(raw, prepare_chat)
        return await respond(raw, body, ids, max_new_tokens=body.max_new_tokens, chat=True)

    async def respond(raw, body, prompt_ids: list[int], max_new_tokens: int | None, chat: bool):
        if body.model not in (None, model_name):
            raise APIError(f"model: {short_repr(body.model)} is not served here; /v1/models lists {model_name!r}",
                           "model", status=404)
        stop = body.stop_strings()
        request = make_request(body, prompt_ids, max_new_tokens, context, chat)
        try:
            stream = engine.submit(request)
        except QueueFullError as e:
            raise APIError(str(e), status=503, kind="server_overloaded", headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise APIError(str(e), status=503, kind="server_error") from None
        except (TypeError, ValueError) as e:
            raise api_error_of(e) from None
        text = TextAssembler(tokenizer, stop, body.skip_special_tokens, body.min_tokens)
        out = Output(request.request_id, model_name, chat, len(prompt_ids), text)
        out.continuous_usage = body.stream and body.continuous_usage
        if body.stream:
            return StreamingResponse(sse(engine, stream, out, body.include_usage), media_type="text/event-stream")
        return await collect(raw, engine, stream, out)

    return app


class Output:
    """Builds the response bodies of one request (completion or chat, chunk or whole)."""

    def __init__(self, request_id: str, model: str, chat: bool, num_prompt_tokens: int, text: TextAssembler):
        self.id, self.model, self.chat, self.text = request_id, model, chat, text
        self.created = int(time.time())
        self.num_prompt_tokens, self.num_output_tokens = num_prompt_tokens, 0
        self.finish_reason: str | None = None
        self.continuous_usage = False  # vLLM's stream_options.continuous_usage_stats: usage in every chunk

    def usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_output_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_output_tokens}

    def feed(self, delta) -> str:
        """Take a TokenDelta; returns the new text (a stop string sets finish_reason "stop")."""
        self.num_output_tokens += len(delta.token_ids)
        piece, stopped = self.text.feed(delta.token_ids, final=delta.finish_reason is not None)
        if stopped:
            self.finish_reason = "stop"
        elif delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        return piece

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, piece: str, first: bool = False) -> dict:
        head = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model}
        if self.chat:
            delta = {"role": "assistant", "content": piece} if first else ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": self.finish_reason}
        return {**head, "choices": [choice]} | ({"usage": self.usage()} if self.continuous_usage else {})

    def whole(self, text: str) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}


def event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def sse(engine: AsyncEngine, stream, out: Output, include_usage: bool):
    """The SSE body: a chunk per step with text (chat: the first one carries the role and is sent with the first
    token, as vLLM does, so a client's time to first chunk is the TTFT), the last with finish_reason, a usage
    chunk if asked, then ``[DONE]``. A stop string ends the request early (finish_reason "stop"); a client that
    leaves cancels this generator, which aborts the request."""
    first = out.chat
    try:
        async for delta in stream:
            piece = out.feed(delta)
            if out.finish_reason is not None:
                stop_early(engine, out, delta)
                yield event(out.chunk(piece, first=first))
                break
            if piece or first:
                yield event(out.chunk(piece, first=first))
                first = False
    except EngineDeadError as e:  # the response has started: the error goes into the stream
        yield event(APIError(str(e), status=503, kind="server_error").body())
    finally:
        await stream.aclose()
    if include_usage:
        yield event({"id": out.id, "object": out.chunk_object, "created": out.created, "model": out.model,
                     "choices": [], "usage": out.usage()})
    yield event("[DONE]")


def stop_early(engine: AsyncEngine, out: Output, delta) -> None:
    """A stop string ended the text before the engine finished: finish the request ("stop")."""
    if out.finish_reason == "stop" and delta.finish_reason is None:
        engine.abort(out.id, reason="stop")


async def collect(raw: HTTPRequest, engine: AsyncEngine, stream, out: Output) -> dict:
    """The whole response; the request is aborted if its client disconnects while waiting."""
    async def run() -> str:
        text = ""
        try:
            async for delta in stream:
                text += out.feed(delta)
                if out.finish_reason is not None:
                    stop_early(engine, out, delta)
                    break
        finally:
            await stream.aclose()
        return text

    task = asyncio.ensure_future(run())
    while not task.done():  # Starlette does not cancel a plain handler whose client left: look
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await raw.is_disconnected():
            task.cancel()  # closes the stream: the request is aborted
            return Response(status_code=499)
    try:
        return out.whole(task.result())
    except EngineDeadError as e:  # the engine stopped while this request ran
        raise APIError(str(e), status=503, kind="server_error") from None
