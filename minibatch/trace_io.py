"""Trace files: save a list of Requests' inputs as JSON and load them back, refusing every malformed file.

The format is "minibatch-trace-v1": ``{"format": "minibatch-trace-v1", "requests": [...]}``, one request
object per line (see :func:`save_trace`). :func:`load_trace` checks the file's shape here and leaves the
values' types and ranges to ``Request`` and ``SamplingParams`` (one place each), so a bad file raises one
``ValueError`` naming the file, the request index and the field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from minibatch.checks import FieldTypeError, check_in_vocab, check_int, short_repr
from minibatch.request import Request, SamplingParams

TRACE_FORMAT = "minibatch-trace-v1"


def save_trace(requests: list[Request], path: str | Path) -> None:
    """Write the requests' inputs (not engine state) as JSON, format "minibatch-trace-v1",
    atomically (:func:`minibatch.files.atomic_write_text`: a failed write keeps the old file).

    One request per line: request_id, prompt_token_ids, max_new_tokens, sampling (the
    SamplingParams fields), arrival_time_s (s), prompt_text (or null), priority (int), and where set
    (OPTIONAL_FIELDS): parent_request_id, num_speculative_tokens, num_external_computed_tokens.

    Raises:
        ValueError: no requests, or a non-finite number (e.g. arrival_time_s = inf) that JSON
            cannot hold and :func:`load_trace` would refuse (names the request).
        OSError: the file cannot be written (the old file is kept).
    """
    from minibatch.files import atomic_write_text

    if isinstance(requests, Request) or not all(isinstance(r, Request) for r in requests):
        raise FieldTypeError(f"requests must be a list of Requests, got {short_repr(requests)}")
    if not requests:
        raise ValueError("requests must hold >= 1 request (load_trace refuses an empty trace)")
    rows = []
    for r in requests:
        row = {"request_id": r.request_id, "prompt_token_ids": r.prompt_token_ids,
               "max_new_tokens": r.max_new_tokens, "sampling": dataclasses.asdict(r.sampling),
               "arrival_time_s": r.arrival_time_s, "prompt_text": r.prompt_text, "priority": r.priority}
        row |= {k: getattr(r, k) for k, unset in OPTIONAL_FIELDS.items() if getattr(r, k) != unset}
        try:
            rows.append(json.dumps(row, separators=(",", ":"), allow_nan=False))
        except ValueError:
            raise ValueError(f"request {r.request_id!r}: a value is not a finite number "
                             f"(arrival_time_s = {r.arrival_time_s}, sampling = {r.sampling}); "
                             "JSON cannot hold it") from None
    body = ",\n".join(rows)
    atomic_write_text(path, f'{{"format": "{TRACE_FORMAT}", "requests": [\n{body}\n]}}\n')


# The keys of a trace file; "sampling" holds SamplingParams fields.
TRACE_KEYS = ("format", "requests")
# Request fields a trace row holds only where set (their value when unset): a fork's parent (parallel sampling),
# a request's own speculative k, KV that arrives from elsewhere (disaggregated prefill)
OPTIONAL_FIELDS = {"parent_request_id": None, "num_speculative_tokens": None, "num_external_computed_tokens": 0}
TRACE_REQUEST_KEYS = ("request_id", "prompt_token_ids", "max_new_tokens", "sampling", "arrival_time_s",
                      "prompt_text", "priority", *OPTIONAL_FIELDS)
TRACE_REQUIRED_KEYS = ("request_id", "prompt_token_ids", "max_new_tokens")


def _check_trace_request(row) -> None:
    """The shape of a trace row: an object with known keys, the required ones present, sampling an
    object of SamplingParams fields. Types and ranges of the values are Request's and
    SamplingParams' checks (one place each). Raises ValueError naming the field."""
    if not isinstance(row, dict):
        raise ValueError(f"must be an object with keys {', '.join(TRACE_REQUEST_KEYS)}; got {type(row).__name__}")
    unknown = [k for k in row if k not in TRACE_REQUEST_KEYS]
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(TRACE_REQUEST_KEYS)})")
    missing = [k for k in TRACE_REQUIRED_KEYS if k not in row]
    if missing:
        raise ValueError(f"missing field {missing[0]!r} (required: {', '.join(TRACE_REQUIRED_KEYS)})")
    sampling = _default(row, "sampling", {})
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    if not isinstance(sampling, dict):
        raise ValueError(f"sampling must be an object with keys among {', '.join(fields)}, "
                         f"got {short_repr(sampling)}")
    unknown = [k for k in sampling if k not in fields]
    if unknown:
        raise ValueError(f"sampling: unknown key(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(fields)})")


def _default(row: dict, key: str, default):
    """An optional field's value; missing or null (JSON's "not given") is its default."""
    value = row.get(key)
    return default if value is None else value


def load_trace(path: str | Path, vocab_size: int | None = None) -> list[Request]:
    """Read a trace written by :func:`save_trace` into fresh Requests.

    A trace is ``{"format": "minibatch-trace-v1", "requests": [...]}`` with >= 1 request, each an
    object with request_id (non-empty string, unique), prompt_token_ids (non-empty list of ints
    >= 0, below ``vocab_size`` when given), max_new_tokens (int >= 1), and optionally
    arrival_time_s (finite number >= 0, default 0), sampling (SamplingParams fields), priority
    (int, default 0), prompt_text (string or null), and the Request fields of OPTIONAL_FIELDS; an optional field
    that is null gets its default. No other keys.

    Raises:
        ValueError: every bad file: missing, a folder, binary, empty, truncated or not JSON, wrong
            top-level type, missing/wrong "format" or "requests", no requests, and any request
            with a missing, unknown, mistyped or out-of-range field or a repeated request_id; the
            message names the file, the request index and the field with its allowed values.
    """
    from minibatch.files import read_json

    if vocab_size is not None:
        check_int(vocab_size, "vocab_size", 1)
    data = read_json(path, what="trace")
    if not isinstance(data, dict):
        raise ValueError(f'{path}: a trace must be a JSON object {{"format": "{TRACE_FORMAT}", "requests": [...]}}, '
                         f"got a {type(data).__name__}")
    for key in TRACE_KEYS:
        if key not in data:
            raise ValueError(f"{path}: missing key {key!r} (a trace is "
                             f'{{"format": "{TRACE_FORMAT}", "requests": [...]}})')
    unknown = [k for k in data if k not in TRACE_KEYS]
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(TRACE_KEYS)})")
    if data["format"] != TRACE_FORMAT:
        raise ValueError(f"{path}: format must be {TRACE_FORMAT!r}, got {short_repr(data['format'])}")
    rows = data["requests"]
    if not isinstance(rows, list):
        raise ValueError(f"{path}: 'requests' must be a list of request objects, got a {type(rows).__name__}")
    if not rows:
        raise ValueError(f"{path}: 'requests' is empty; a trace needs >= 1 request")
    out, seen = [], {}
    for i, row in enumerate(rows):
        try:
            _check_trace_request(row)
            if row["request_id"] in seen:
                raise ValueError(f"request_id {row['request_id']!r} repeats request {seen[row['request_id']]}'s "
                                 "(ids must be unique)")
            seen[row["request_id"]] = i
            try:
                sampling = SamplingParams(**_default(row, "sampling", {}))
            except (TypeError, ValueError) as e:
                raise ValueError(f"sampling.{e}") from None
            try:
                r = Request(row["request_id"], row["prompt_token_ids"], max_new_tokens=row["max_new_tokens"],
                            sampling=sampling,
                            arrival_time_s=_default(row, "arrival_time_s", 0.0),
                            prompt_text=row.get("prompt_text"), priority=_default(row, "priority", 0),
                            **{k: _default(row, k, unset) for k, unset in OPTIONAL_FIELDS.items()})
            except (TypeError, ValueError) as e:  # Request's own message, less its "request 'id': " prefix
                raise ValueError(str(e).removeprefix(f"request {row['request_id']!r}: ")) from None
            if vocab_size is not None:
                check_in_vocab(r.prompt_token_ids, vocab_size)
            out.append(r)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: request {i}: {e}") from None
    return out


def describe_trace(requests: list[Request]) -> str:
    """One line for a trace: its requests, prompt and output tokens, and the time its arrivals span (from t = 0 to
    the latest, whatever the order of the requests)."""
    return (f"{len(requests)} requests, {sum(r.num_prompt_tokens for r in requests)} prompt + "
            f"{sum(r.max_new_tokens for r in requests)} output tokens, arrivals over "
            f"{max(r.arrival_time_s for r in requests):.1f} s")


def check_fits_context(requests: list[Request], max_model_len: int | None, whose: str = "") -> None:
    """Raise ValueError naming the requests (up to 5) whose prompt plus max_new_tokens exceeds ``max_model_len``
    (``whose``: "smollm2-135m's " or ""; None: no limit known), and the options that shape a trace's lengths: a run
    fails before its work, and no request is dropped silently."""
    too_long = [r.request_id for r in requests if max_model_len is not None and r.max_num_tokens > max_model_len]
    if too_long:
        raise ValueError(f"requests {too_long[:5]}{' ...' if len(too_long) > 5 else ''} need more than {whose}"
                         f"max_model_len = {max_model_len} tokens (--max-prompt-len, --max-output-len, "
                         "--long-prompt-len, --trace)")
