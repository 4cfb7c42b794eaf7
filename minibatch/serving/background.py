"""Servers in the background of a test, a notebook or a benchmark: :class:`ServerThread` (uvicorn serving an app
of :func:`minibatch.serving.launch.build_server` in a thread of this process) and :class:`ServerProcess` (``python
-m minibatch serve`` or another server's command as a child process)."""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from minibatch.serving.async_engine import AsyncEngine


class ServerThread:
    """uvicorn serving ``app`` in a daemon thread of this process, on 127.0.0.1 and a free port (``base_url``:
    ``http://127.0.0.1:PORT/v1``). ``stop()`` (or leaving the ``with``) closes the port and shuts down ``engine``."""

    def __init__(self, app, engine: AsyncEngine | None = None, host: str = "127.0.0.1"):
        from minibatch.serving.connections import http_server

        self.engine = engine
        self.server = http_server(app, host, 0, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.thread = threading.Thread(target=self.server.run, name="minibatch-http", daemon=True)
        self.host, self.port = host, None

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        """Serve; returns self once started. RuntimeError: the server thread died first, or timeout_s passed."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        if self.engine is not None:
            self.engine.shutdown()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RUNNING_CHILDREN: set["ServerProcess"] = set()  # started and not stopped: ended at interpreter exit


@atexit.register
def stop_running_children() -> None:
    """Stop every ServerProcess still running (registered with ``atexit``: no child outlives us)."""
    for child in list(RUNNING_CHILDREN):
        child.stop()


class ServerProcess:
    """``python -m minibatch serve ARGS --port PORT`` as a child process, its output in ``log`` (a file path);
    ``start()`` waits for /health. ``stop()`` (or leaving the ``with``) ends it (and its port); so does the exit of this
    interpreter, should nobody call it (a notebook cell that failed between start and stop).

    command: another server's command line instead (e.g. ``transformers serve``, ``vllm serve``), "{port}" in it
    replaced by the port; it must answer GET /health. env: variables added to the child's environment;
    start_timeout_s: how long ``with`` waits for /health (a compiling server needs minutes)."""

    def __init__(self, args: list[str], log: str, port: int | None = None, command: list[str] | None = None,
                 env: dict | None = None, start_timeout_s: float = 180.0):
        self.port, self.env, self.start_timeout_s = port or free_port(), env, start_timeout_s
        self.args = ([x.replace("{port}", str(self.port)) for x in command] if command else
                     [sys.executable, "-m", "minibatch", "serve", *args, "--port", str(self.port)])
        self.log, self.proc = log, None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float | None = None) -> "ServerProcess":
        """Spawn and wait for /health. RuntimeError: the child exited first, or timeout_s passed (then stopped)."""
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT,
                                         env=None if self.env is None else os.environ | self.env)
        RUNNING_CHILDREN.add(self)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return self
            except OSError:
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout_s} s; see {self.log}")

    def stop(self) -> None:
        """Terminate the child (SIGTERM, then SIGKILL after 15 s) and wait for it; no-op once it ended."""
        RUNNING_CHILDREN.discard(self)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
