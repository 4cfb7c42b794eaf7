"""Connections no client can hold forever: uvicorn's HTTP/1.1 protocol (h11) with deadlines and a cap.

uvicorn closes an idle keep-alive connection after a few seconds, but a connection that has started a request and
never finishes its headers, or its body, is held as long as the client likes; enough of them ("slowloris") take
every file descriptor, and then no one else is served and asyncio logs a traceback for every refused accept. Here:

* a request's headers must be complete within :data:`HEADER_TIMEOUT_S` of the connection or of their first byte
  after the previous response (a 408 error object, then the connection closes; headers that arrive while an
  earlier response is still being sent are closed by uvicorn's keep-alive timeout instead);
* its body must arrive at :data:`MIN_BODY_BYTES_PER_S` after a grace of :data:`HEADER_TIMEOUT_S`
  (:func:`body_deadline_s`; :func:`read_body` answers 408), and a connection answered before its body was in
  is closed :data:`LINGER_S` later (the rest of the body is not waited for);
* at most :func:`max_connections` connections are open (from the file-descriptor limit, which :func:`server_config`
  first raises to its hard maximum, as vLLM's server does); one more is answered 503 and closed at once, and the
  listening socket's backlog is a quarter of the cap, so a burst of connects cannot take the descriptors left;
* a client that reads none of its response for :data:`SEND_TIMEOUT_S` while bytes wait for it (the socket's buffers
  full, ours not shrinking) has its connection aborted, and its request with it: a client that stops reading a
  stream, or never reads its answer, would otherwise hold the connection, and the bytes waiting for it, for ever;
* malformed HTTP (a bad request line, chunk size or Content-Length) gets an OpenAI error object, not plain text.

The deadlines follow the request-timeout rules web servers use (nginx's ``client_header_timeout`` and
``client_body_timeout``, Apache's ``mod_reqtimeout``: a time for the headers, a minimum rate for the body; nginx's
``send_timeout`` for the response).
"""

from __future__ import annotations

import asyncio
import json

import h11
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from uvicorn.protocols.http.h11_impl import H11Protocol

from minibatch.checks import short_repr
from minibatch.machine import raise_fd_limit
from minibatch.serving.protocol import APIError

HEADER_TIMEOUT_S = 20.0  # a request's headers, from the connection (or their first byte on a kept-alive one)
MIN_BODY_BYTES_PER_S = 64 << 10  # after the same grace: an 8 MiB body may take 20 + 128 s
MAX_BODY_BYTES = 8 << 20  # default body-size limit: far above any prompt a 2k-8k-token context holds
SEND_TIMEOUT_S = 60.0  # a response's bytes unread this long abort the connection (nginx's send_timeout default)
LINGER_S = 5.0  # after answering a request whose body is still coming: how long its bytes are still read
MAX_CONNECTIONS = 10_000  # the cap when the file-descriptor limit allows more
REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


def body_deadline_s(content_length: int) -> float:
    """Seconds a body of ``content_length`` bytes may take to arrive (the grace plus the minimum rate)."""
    return HEADER_TIMEOUT_S + content_length / MIN_BODY_BYTES_PER_S


async def read_body(raw: HTTPRequest, max_body_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The body's bytes. Raises APIError 413 over ``max_body_bytes`` (by Content-Length before reading, or while
    reading), 408 when it arrives slower than :func:`body_deadline_s` allows, 415 for a Content-Encoding other than
    identity (a compressed body is not decoded here), 499 when the client leaves before its end."""
    too_big = APIError(f"the body is larger than this server's limit of {max_body_bytes} bytes (--max-body-bytes)",
                       status=413)
    encoding = raw.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(f"Content-Encoding {short_repr(encoding)} is not supported: send the body uncompressed",
                       status=415)
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise too_big
    deadline_s = body_deadline_s(int(declared) if declared.isdigit() else max_body_bytes)

    async def whole() -> bytes:
        data = bytearray()
        async for chunk in raw.stream():
            data += chunk
            if len(data) > max_body_bytes:
                raise too_big
        return bytes(data)

    try:
        return await asyncio.wait_for(whole(), deadline_s)
    except ClientDisconnect:  # nobody is left to answer: 499 (client closed request), not a traceback in the log
        raise APIError("the client closed the connection before its body was complete", status=499) from None
    except asyncio.TimeoutError:
        raise APIError(f"the body did not arrive within {deadline_s:.0f} s (at least {MIN_BODY_BYTES_PER_S >> 10} "
                       f"KiB/s after {HEADER_TIMEOUT_S:g} s)", status=408) from None


def max_connections() -> int:
    """Open connections allowed: half the file-descriptor limit (the rest for the model, logs and accepts in flight),
    at most :data:`MAX_CONNECTIONS`, at least 16."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no such limit here (Windows)
        return MAX_CONNECTIONS
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(16, min(MAX_CONNECTIONS, soft // 2))


def raw_error(error: APIError) -> bytes:
    """A whole HTTP/1.1 response carrying ``error``'s OpenAI error object, for a connection h11 cannot answer (no
    request parsed yet, or one it could not parse); the connection closes after it."""
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {error.status} {REASONS.get(error.status, 'Error')}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers, a send timeout, a cap on open connections
    and OpenAI error objects for malformed HTTP (see the module's docstring)."""

    header_timer = send_timer = None
    send_waiting = 0  # bytes in our buffer when the send timer was (re)armed

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # writing pauses as soon as a byte waits in our buffer (the kernel's send buffer is full: the client is not
        # reading), not at 64 KiB: a few KiB left unread would otherwise keep a closed connection open for ever
        transport.set_write_buffer_limits(high=0)
        most = getattr(self.config, "minibatch_max_connections", MAX_CONNECTIONS)
        if len(self.connections) > most:
            self.refuse(APIError(f"this server has {most} connections open, its most; retry later", status=503,
                                 kind="server_overloaded"))
            return
        self.arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # (it cancels uvicorn's keep-alive timer: data came)
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self.disarm()
        elif self.transport.is_closing() or self.header_timer is not None:
            pass
        elif self.conn.trailing_data[0]:  # a new request has begun: its headers have their deadline
            self.arm()
        elif self.timeout_keep_alive_task is None:  # idle again (no new request yet): uvicorn's keep-alive rule
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # answered before its body was in (a 408, 413 or 415, or a route that reads no body): the rest of the
            # body would be read and dropped for as long as the client sends it. A lingering close, as web servers
            # do: what comes in LINGER_S is still dropped (closing at once would reset the connection, and the
            # client could lose the answer), then the connection ends unless the body was done by then
            self.loop.call_later(LINGER_S, self.linger_end, self.cycle)

    def linger_end(self, cycle) -> None:
        if self.cycle is cycle and self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()  # (a later request on this connection, its own cycle, is left alone)

    def connection_lost(self, exc) -> None:
        self.disarm()
        if self.send_timer is not None:
            self.send_timer.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:  # the client has not read what was sent: it has SEND_TIMEOUT_S to read on
        super().pause_writing()
        if self.send_timer is None:
            self.arm_send()

    def arm_send(self) -> None:
        self.send_waiting = self.transport.get_write_buffer_size()
        self.send_timer = self.loop.call_later(SEND_TIMEOUT_S, self.send_late)

    def resume_writing(self) -> None:  # our buffer is empty again
        super().resume_writing()
        if self.send_timer is not None:
            self.send_timer.cancel()
            self.send_timer = None

    def send_late(self) -> None:
        self.send_timer = None
        if self.transport.get_write_buffer_size() < self.send_waiting:  # it read some: SEND_TIMEOUT_S more
            self.arm_send()
        else:  # nothing read in SEND_TIMEOUT_S (no answer can reach it): the connection and its request end
            self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        self.refuse(APIError(f"invalid HTTP request: {msg.rstrip('.').lower()} (the request line, a header, "
                             "Content-Length or a chunk size is malformed)"))

    def arm(self) -> None:
        self.header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self.headers_late)

    def disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def headers_late(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
            self.refuse(APIError(f"the request's headers did not arrive within {HEADER_TIMEOUT_S:g} s", status=408))

    def refuse(self, error: APIError) -> None:
        self.disarm()
        if not self.transport.is_closing():
            self.transport.write(raw_error(error))
            self.transport.close()


def server_config(app, host: str, port: int, **options):
    """uvicorn's Config for ``app`` on :class:`DeadlineH11Protocol`, after :func:`raise_fd_limit`; ``options`` go
    to uvicorn.Config (log_level, lifespan, timeout_graceful_shutdown, ...)."""
    import uvicorn

    raise_fd_limit()
    most = max_connections()
    # asyncio accepts up to `backlog` connections at a time before any is seen (and over the cap closed): a burst
    # must not take the descriptors the cap leaves free
    options.setdefault("backlog", max(16, min(2048, most // 4)))
    config = uvicorn.Config(app, host=host, port=port, http=DeadlineH11Protocol, **options)
    config.minibatch_max_connections = most
    return config


def http_server(app, host: str, port: int, **options):
    """A uvicorn Server on :func:`server_config` (``port`` 0: a free one)."""
    import uvicorn

    return uvicorn.Server(server_config(app, host, port, **options))
