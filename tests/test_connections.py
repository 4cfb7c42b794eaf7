"""Connections no client can hold forever (minibatch/serving/connections.py): a request's headers within a deadline,
its body at a minimum rate, a cap on open connections, and OpenAI error objects where uvicorn answered plain text.
Each case failed before: the server held such connections as long as the client liked (enough of them took every
file descriptor, and then nobody was served). Raw sockets play the clients; the deadlines are shortened here."""

import gzip
import json
import socket
import time

import httpx
from fastapi.responses import Response
import pytest

from minibatch.serving import connections
from minibatch.serving.background import ServerThread
from minibatch.serving.launch import build_server

MODEL = "tiny-random-llama"
BODY = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def server(loaded):
    app, engine = build_server(MODEL, "paged", dict(n_slots=256, block_size=4, max_num_seqs=4), loaded=loaded)
    with ServerThread(app, engine) as srv:
        yield srv


@pytest.fixture
def short_deadlines(monkeypatch):
    monkeypatch.setattr(connections, "HEADER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(connections, "LINGER_S", 0.5)  # after a 408 to a body still coming


def raw(srv, data: bytes = b"", wait_s: float = 10.0) -> tuple[int, dict]:
    """Send ``data`` on a new connection and read until the server closes it: (status, JSON body)."""
    with socket.create_connection((srv.host, srv.port), timeout=wait_s) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def request_bytes(body: bytes = BODY, headers: str = "") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_headers_that_never_end_get_408_and_the_connection_closes(server, short_deadlines):
    for started in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):  # nothing at all, or half the headers
        t0 = time.monotonic()
        status, body = raw(server, started)
        assert status == 408 and "headers did not arrive within 0.5 s" in body["error"]["message"]
        assert time.monotonic() - t0 < 3.0


def test_a_body_slower_than_the_minimum_rate_gets_408(server, short_deadlines):
    t0 = time.monotonic()
    status, body = raw(server, request_bytes()[:-len(BODY) + 5])  # five bytes of the body, then nothing
    assert status == 408 and "the body did not arrive within" in body["error"]["message"]
    assert time.monotonic() - t0 < 4.0  # answered, then the connection closed after the lingering close


def test_a_kept_alive_connection_gets_a_second_request_and_a_long_response_is_not_cut(server, short_deadlines):
    with httpx.Client(base_url=server.base_url, timeout=10) as c:  # one connection, kept alive
        first = c.post("/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2})
        time.sleep(1.0)  # idle longer than the header deadline, shorter than uvicorn's keep-alive
        second = c.post("/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2})
        assert first.status_code == second.status_code == 200
    # half the headers of a second request on a kept-alive connection: the deadline starts again
    with socket.create_connection((server.host, server.port), timeout=5) as s:
        s.sendall(request_bytes())
        time.sleep(0.5)  # its response is out
        s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        replies = b""
        while chunk := s.recv(65536):
            replies += chunk
    assert b"200 OK" in replies and b"408 Request Timeout" in replies


def test_connections_over_the_cap_get_503_and_the_server_recovers(server):
    config = server.server.config
    before = config.minibatch_max_connections
    config.minibatch_max_connections = 3
    held = [socket.create_connection((server.host, server.port)) for _ in range(3)]
    try:
        time.sleep(0.2)
        status, body = raw(server)
        assert status == 503 and body["error"]["type"] == "server_overloaded"
    finally:
        for s in held:
            s.close()
        config.minibatch_max_connections = before
    time.sleep(0.2)
    assert httpx.post(server.base_url + "/completions", content=BODY, timeout=10).status_code == 200


MALFORMED = [b"HELLO\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
             b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"]


@pytest.mark.parametrize("data", MALFORMED)
def test_malformed_http_gets_an_openai_error_object(server, data):
    status, body = raw(server, data)
    assert status == 400 and body["error"]["message"].startswith("invalid HTTP request")


def test_a_compressed_body_is_refused_naming_its_encoding(server):
    sent = httpx.post(server.base_url + "/completions", content=gzip.compress(BODY),
                      headers={"content-encoding": "gzip", "content-type": "application/json"}, timeout=10)
    assert sent.status_code == 415 and "Content-Encoding 'gzip'" in sent.json()["error"]["message"]


def test_the_connection_cap_follows_the_file_descriptor_limit(monkeypatch):
    resource = pytest.importorskip("resource")
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 1024))
    assert connections.max_connections() == 512
    monkeypatch.setattr(resource, "getrlimit", lambda what: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert connections.max_connections() == connections.MAX_CONNECTIONS
    assert connections.body_deadline_s(8 << 20) == connections.HEADER_TIMEOUT_S + 128


@pytest.mark.parametrize("head", [b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 90000000\r\n\r\n"])
def test_a_connection_answered_before_its_body_arrived_is_closed(server, head, monkeypatch):
    """A route that reads no body (200) or a body refused by its length (413): the connection closes soon after the
    answer (a lingering close, so the answer is read), instead of reading and dropping a slowly sent body for as
    long as the client likes."""
    monkeypatch.setattr(connections, "LINGER_S", 0.5)
    with socket.create_connection((server.host, server.port), timeout=5) as s:
        s.sendall(head)
        reply, t0 = b"", time.monotonic()
        while time.monotonic() - t0 < 4:
            try:
                s.sendall(b"x")
            except OSError:
                break
            s.settimeout(0.3)
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 ") and time.monotonic() - t0 < 3.5  # closed, not held


LONG_STREAM = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 500, "stream": True, "ignore_eos": True,
                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()


@pytest.fixture
def small_buffers_server(loaded, monkeypatch):  # (its app also has /big: one 150,000-byte write)
    """A server whose sockets have a small send buffer (as a long response, or a slow network, fills a large one),
    a SEND_TIMEOUT_S of 0.5 s, and a context for LONG_STREAM (~40 KB of events); and a client socket with a small
    receive buffer."""
    monkeypatch.setattr(connections, "SEND_TIMEOUT_S", 0.5)
    made = connections.DeadlineH11Protocol.connection_made

    def small_send_buffer(self, transport):
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        made(self, transport)

    monkeypatch.setattr(connections.DeadlineH11Protocol, "connection_made", small_send_buffer)
    app, engine = build_server(MODEL, "paged", dict(n_slots=2048, block_size=16, max_num_seqs=4), loaded=loaded)
    app.add_api_route("/big", lambda: Response(b"x" * 150_000))
    with ServerThread(app, engine) as srv, socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        yield srv, s


def test_a_client_that_stops_reading_its_stream_is_cut_off(small_buffers_server):
    """A client that reads nothing of a long stream: once the sockets' buffers are full, its bytes wait in ours;
    after SEND_TIMEOUT_S the connection is aborted (before, it was held for ever: the response ended, and the
    keep-alive timeout's close waited for the unread bytes), and others are served meanwhile."""
    srv, s = small_buffers_server
    state = srv.server.server_state
    s.connect((srv.host, srv.port))
    s.sendall(request_bytes(LONG_STREAM))  # none of it is read
    t0 = time.monotonic()
    while not state.connections and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    mine = set(state.connections)
    assert len(mine) == 1
    assert httpx.post(srv.base_url + "/completions", content=BODY, timeout=10).status_code == 200
    while mine & state.connections and time.monotonic() - t0 < 15:
        time.sleep(0.1)
    assert not mine & state.connections, "the connection of a client that reads nothing is still open"
    assert time.monotonic() - t0 < 5


def test_a_client_that_reads_slowly_is_not_cut_off(small_buffers_server):
    """The send timeout counts time without progress: a client that keeps reading, slower than the stream is made,
    gets all of it, though it takes several SEND_TIMEOUT_S."""
    srv, s = small_buffers_server
    s.connect((srv.host, srv.port))
    s.sendall(request_bytes(LONG_STREAM))
    s.settimeout(10)
    reply, t0, end = b"", time.monotonic(), b"data: [DONE]\n\n\r\n0\r\n\r\n"
    while not reply.endswith(end) and time.monotonic() - t0 < 30:
        chunk = s.recv(1024)  # ~20 KB/s
        if not chunk:
            break
        reply += chunk
        time.sleep(0.05)
    assert reply.endswith(end) and time.monotonic() - t0 > 1.0


def test_a_client_that_reads_one_large_write_slowly_is_not_cut_off(small_buffers_server):
    """One large write never empties our buffer until it is all read, so writing never resumes: the timer is armed
    again whenever the client read some (before, it was aborted SEND_TIMEOUT_S after the pause, 30 KB in)."""
    srv, s = small_buffers_server
    s.connect((srv.host, srv.port))
    s.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(10)
    reply, t0 = b"", time.monotonic()
    while len(reply) < 150_000 and time.monotonic() - t0 < 30:
        chunk = s.recv(2048)  # ~100-200 KB/s at most: several SEND_TIMEOUT_S in all
        if not chunk:
            break
        reply += chunk
        time.sleep(0.01)
    assert reply.endswith(b"x" * 1000) and len(reply.partition(b"\r\n\r\n")[2]) == 150_000

def test_the_send_timer_is_armed_again_while_the_client_reads_and_aborts_when_it_stops():
    """One large write (the buffer never empties, so writing never resumes): a client that read some of it within
    SEND_TIMEOUT_S gets SEND_TIMEOUT_S more; one that read nothing is aborted (nginx's send_timeout, between two
    successive reads)."""
    from types import SimpleNamespace

    for left, expected in ((150_000, ["armed again"]), (200_000, ["aborted"])):
        calls = []
        transport = SimpleNamespace(get_write_buffer_size=lambda: left, abort=lambda: calls.append("aborted"))
        protocol = SimpleNamespace(transport=transport, send_waiting=200_000, send_timer="armed",
                                   arm_send=lambda: calls.append("armed again"))
        connections.DeadlineH11Protocol.send_late(protocol)
        assert calls == expected and protocol.send_timer is None
