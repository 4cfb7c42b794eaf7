"""The OpenAI API subset we serve: request bodies (pydantic), checks, error bodies and the engine Request of a body.

What a body may hold: the fields of ``CompletionRequest`` / ``ChatCompletionRequest`` (vLLM's
extensions ``top_k``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids`` and ``stream_options.continuous_usage_stats``
included, each honoured as vLLM does). An OpenAI
parameter we do not implement (``UNSUPPORTED``: logprobs, penalties, n > 1, tools, ...) is refused with HTTP
400 naming it unless it holds its no-op default, and so is any unknown field: never silently ignored. ``null``
means "not given" (the field's default), as the OpenAI spec allows; values are never coerced from another JSON
type (``"4"`` is not a number, ``"no"`` not a boolean).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from minibatch.checks import short_repr
from minibatch.request import Request, SamplingParams

# OpenAI parameters we do not implement -> the values that mean "off" (accepted, they change nothing)
UNSUPPORTED = {
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": (None, {}),
    "suffix": (None,), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,),
    "use_beam_search": (False,),
}
MAX_STOP_STRINGS = 16
VALUES_PER_TOKEN = 16  # a body's JSON values per token of the context (a token of text holds a few commas at most)
# stop_token_ids: every output token is checked against them and, before min_tokens, they are banned each step, so
# a list of millions slowed every request on the server; vLLM sets no limit, this server refuses a longer list
MAX_STOP_TOKEN_IDS = 1024
# message keys of OpenAI's Chat Completions that a client may send back as null (an SDK message's model_dump()):
# null is "not given", as for the body's own fields; given with a value they are refused as unknown fields
MESSAGE_NULLABLE = ("name", "refusal", "tool_calls", "function_call", "audio", "annotations", "tool_call_id")
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # where json.loads can make a lone surrogate (or a pair)


class APIError(Exception):
    """An error answered as an OpenAI error body: HTTP ``status``, ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.headers = message, param, status, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def decode_json(data: bytes, context: Context | None = None):
    """The decoded JSON body. Raises APIError 400 for a body not in UTF-8, invalid JSON, nesting too deep, a
    string no UTF-8 text can hold (a lone surrogate escape such as "\\ud800"), or, given the server's ``context``,
    more JSON values than a request for it can need (:data:`VALUES_PER_TOKEN` per token of it, counted in the bytes
    before they are parsed: parsing a million small values holds Python's GIL, and every other request, for a
    second; a long string is one value and cheap)."""
    if context is not None:
        limit = VALUES_PER_TOKEN * context.tokens + 1024
        values = data.count(b",") + data.count(b"[") + data.count(b"{")  # an over-count: strings' commas too
        if values > limit:
            raise APIError(f"the body holds {values} JSON values (commas, arrays, objects), more than a request for "
                           f"{context} can need (at most {limit})")
    try:
        text = data.decode("utf-8-sig")  # strict (json.loads lets encoded surrogates through); a BOM is dropped
        body = json.loads(text)
        if SURROGATE_ESCAPE.search(text):  # only an escape makes a lone surrogate, which cannot be encoded
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise APIError("the body is not valid JSON: nested too deeply") from None
    except UnicodeEncodeError:
        raise APIError("the body holds a string that is not valid Unicode (a lone surrogate escape)") from None
    except UnicodeDecodeError as e:
        raise APIError(f"the body is not UTF-8 text (JSON must be): {e}") from None
    except ValueError as e:
        raise APIError(f"the body is not valid JSON: {e}") from None
    return body


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's extension (load generators send it): usage in every chunk


class _Common(BaseModel):
    """Fields both endpoints take: sampling (greedy when temperature is 0), stop strings, streaming."""

    # allow_inf_nan: a NaN or Infinity (Python's json reads both) is refused as not finite, not as out of range
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM: -1 or 0 = off
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (fixed output lengths for benchmarks)
    min_tokens: int = Field(0, ge=0)  # vLLM's extension: EOS and stop_token_ids banned before this many tokens
    stop_token_ids: list[int] | None = None  # vLLM's extension: more token ids that end the output
    skip_special_tokens: bool = True  # vLLM's extension: leave special tokens out of the text
    user: str | None = None  # an end-user id; recorded nowhere

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise APIError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings, got {short_repr(stop)}", "stop")
        return stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    """POST /v1/completions: ``prompt`` is a string or a list of token ids (one prompt)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in MESSAGE_NULLABLE}
        return data

    def text(self) -> str:
        """The content as text (a list of parts may hold only {"type": "text", "text": ...} parts, nothing else)."""
        if isinstance(self.content, str):
            return self.content
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in self.content):
            raise APIError("messages: only text content parts are supported", "messages")
        if extra := next((set(p) - {"type", "text"} for p in self.content if set(p) - {"type", "text"}), None):
            raise APIError(f"messages: a text content part holds only type and text, got {short_repr(sorted(extra))}",
                           "messages")
        return "".join(p["text"] for p in self.content)


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions: ``messages`` rendered by the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: up to the model's max_model_len
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse_body(cls: type[BaseModel], body) -> BaseModel:
    """``cls`` from a decoded JSON body.

    Raises:
        APIError: not a JSON object, an unsupported OpenAI parameter with a non-default value,
            an unknown field, a field of the wrong type (no coercion) or out of range (``param`` names it),
            stream_options without stream.
    """
    if not isinstance(body, dict):
        raise APIError(f"the body must be a JSON object, got {type(body).__name__}")
    # null: not given (a required field is then missing); an unknown field is refused even when null
    known = set(cls.model_fields) | set(UNSUPPORTED)
    body = {k: v for k, v in body.items() if v is not None or k not in known}
    for name, allowed in UNSUPPORTED.items():  # the same JSON type too: 0 is not false, 1.0 not the count 1
        if name in body and not any(type(body[name]) is type(a) and body[name] == a for a in allowed):
            raise APIError(f"{name}: not supported by this server (allowed: {', '.join(map(repr, allowed))}), "
                           f"got {short_repr(body[name])}", name)
    try:
        parsed = cls.model_validate({k: v for k, v in body.items() if k not in UNSUPPORTED})
    except ValidationError as e:
        errors = e.errors()
        err = errors[0]
        loc = ".".join(short_name(x) for x in err["loc"])
        what = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        at = next((i for i, x in enumerate(err["loc"]) if i and is_union_branch(x)), None)  # (0: the field)
        if at is not None and err["type"] != "extra_forbidden":
            # a value no branch of a union field takes: name the branches, not the first one's complaint
            branches = dict.fromkeys(x["loc"][at] for x in errors if x["loc"][:at] == err["loc"][:at])
            loc, what = ".".join(short_name(x) for x in err["loc"][:at]), f"must be one of {' | '.join(branches)}"
        raise APIError(f"{loc}: {what}" + (f", got {short_repr(err['input'])}" if err["type"] != "missing" else ""),
                       short_name(err["loc"][0]) if err["loc"] else None) from None
    if getattr(parsed, "stream_options", None) is not None and not parsed.stream:  # as vLLM refuses it
        raise APIError("stream_options: only allowed with stream true", "stream_options")
    return parsed


def short_name(loc_part, limit: int = 64) -> str:
    """A part of an error's location, cut to ``limit`` characters: a client's 1 MB field name must not come back."""
    text = str(loc_part)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def is_union_branch(loc_part) -> bool:
    """Whether a part of a pydantic error's location names a branch of a union ('str', 'list[int]', a model's
    class name) rather than a field or an index."""
    return isinstance(loc_part, str) and (loc_part in ("str", "int", "float", "bool", "dict") or "[" in loc_part
                                          or loc_part[:1].isupper())


def one_prompt(prompt) -> str | list[int]:
    """The single prompt of a completions body (a batch of several is refused)."""
    if not prompt:  # "" or []
        raise APIError("prompt: must not be empty", "prompt")
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(x, int) for x in prompt):
        return list(prompt)
    if len(prompt) != 1:
        raise APIError(f"prompt: one prompt per request is supported, got {len(prompt)}", "prompt")
    return one_prompt(prompt[0])  # [""] and [[]] are empty too


def check_list_lengths(body, context: "Context", message_tokens: int = 0) -> None:
    """Refuse, before the body is validated item by item, a list that cannot fit the context: a completions
    ``prompt`` of token ids past it, or a batch (the errors :func:`one_prompt` and :func:`make_request` give later);
    chat ``messages`` when each takes at least ``message_tokens`` tokens of the chat template (0: not known)."""
    prompt, messages = (body.get("prompt"), body.get("messages")) if isinstance(body, dict) else (None, None)
    if isinstance(prompt, list) and len(prompt) >= context.tokens:
        if isinstance(prompt[0], int) and not isinstance(prompt[0], bool):
            raise APIError(f"prompt: {len(prompt)} tokens do not fit {context}, which must also hold at least 1 "
                           "output token", "prompt")
        raise APIError(f"prompt: one prompt per request is supported, got {len(prompt)}", "prompt")
    stop_ids = body.get("stop_token_ids") if isinstance(body, dict) else None
    if isinstance(stop_ids, list) and len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids, got {len(stop_ids)}", "stop_token_ids")
    if message_tokens and isinstance(messages, list) and len(messages) * message_tokens >= context.tokens:
        raise APIError(f"messages: {len(messages)} messages take at least {message_tokens} tokens each in the chat "
                       f"template, so they do not fit {context}", "messages")


@dataclass(frozen=True)
class Context:
    """The most tokens (prompt + output) one request may hold on this server, ``tokens``: the model's max_model_len
    (``model_tokens``), or fewer where the engine's KV cache holds fewer (``Engine.max_request_tokens``)."""
    tokens: int
    model_tokens: int

    def __str__(self) -> str:
        why = "" if self.tokens >= self.model_tokens else (f" (the model's max_model_len is {self.model_tokens}; this "
                                                           "server's KV cache, or token budget, holds fewer for one "
                                                           "request)")
        return f"this server's context of {self.tokens} tokens{why}"


def make_request(body, prompt_ids: list[int], max_new_tokens: int | None, context: Context, chat: bool) -> Request:
    """The engine Request of a body (max_new_tokens None, or a default the body did not set: at most what fits in the
    context). Raises APIError when the prompt, or the prompt and max_new_tokens, do not fit the context (its limit
    in tokens in the message, named by the field the body gave: max_tokens, or chat's max_completion_tokens)."""
    field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    num_prompt = len(prompt_ids)
    if num_prompt >= context.tokens:  # the prompt alone is too long: not max_tokens' fault
        source = "messages" if chat else "prompt"  # chat's prompt is its templated messages
        raise APIError(f"{source}: {num_prompt} tokens do not fit {context}, which must also hold at least 1 "
                       "output token", source)
    if max_new_tokens is None:
        max_new_tokens = context.tokens - num_prompt
    elif field not in body.model_fields_set:  # completions' default of 16, not asked for: what fits, as vLLM does
        max_new_tokens = min(max_new_tokens, context.tokens - num_prompt)
    if num_prompt + max_new_tokens > context.tokens:
        raise APIError(f"{field}: prompt ({num_prompt}) + {field} ({max_new_tokens}) = "
                       f"{num_prompt + max_new_tokens} tokens do not fit {context}: at most "
                       f"{context.tokens - num_prompt}", field)
    try:
        sampling = SamplingParams(temperature=body.temperature, top_k=max(0, body.top_k), top_p=body.top_p,
                                  seed=body.seed, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                                  stop_token_ids=tuple(body.stop_token_ids or ()))
        return Request(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", prompt_ids, max_new_tokens, sampling)
    except (TypeError, ValueError) as e:
        raise api_error_of(e) from None


API_NAMES = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt"}


def api_error_of(e: Exception) -> APIError:
    """A 400 from an engine-side check, in the API's field names (max_tokens, prompt)."""
    message = str(e).split(": ", 1)[-1] if str(e).startswith("request ") else str(e)
    for ours, theirs in API_NAMES.items():
        message = message.replace(ours, theirs)
    param = next((p for p in ("temperature", "top_k", "top_p", "seed", "stop_token_ids", "min_tokens", "max_tokens",
                              "prompt") if p in message), None)
    return APIError(message, param)
