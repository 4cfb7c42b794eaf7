"""Start a server: ``python -m minibatch serve`` (uvicorn in the foreground), or build one (:func:`build_server`) to
run in the background of a test or a notebook (``minibatch.serving.background``)."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

from minibatch.clock import LiveClock
from minibatch.precision import dtype_name, resolve_dtype
from minibatch.serving.async_engine import AsyncEngine, warm_up
from minibatch.serving.metrics import ServingMetrics

# Chunked prefill (decodes first, prompts in chunks of the token budget; vLLM's default scheduling too) and the
# sdpa attention backend (CPU and CUDA, nothing to compile): with SmolLM2 on a 2-core CPU one 2000-token prompt
# held every running stream for 8.35 s under paged with torch attention, 0.78 s under these, 0.28 s with
# --attention-backend cpp (python benchmarks/long_prompt_stall.py, data/cpu/long_prompt_stall.json)
DEFAULT_POLICY, DEFAULT_ATTENTION_BACKEND = "chunked", "sdpa"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The serve command's own options (the model's come from ModelConfig, policy settings from their configs)."""
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"scheduling policy (default: {DEFAULT_POLICY})")
    p.add_argument("--served-model-name", default=None, help="the id /v1/models shows (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument("--max-num-waiting", type=int, default=256,
                   help="most requests waiting for admission; one more gets HTTP 503 (default: 256)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: refuse new requests (503) and let running ones finish for this long, "
                        "then end the rest with finish_reason \"abort\" (default: 30)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body; a larger one gets HTTP 413 (default: 8 MiB)")
    p.add_argument("--policy-module", action="append", default=[], metavar="FILE.py",
                   help="a Python file registering policies, attention backends, routers or queue policies; repeatable")
    from minibatch.runner.backends import backend_names

    p.add_argument("--attention-backend", default=DEFAULT_ATTENTION_BACKEND, metavar="{" + ",".join(backend_names())
                   + "}", help="our packed attention: a registered attention backend (cpp: the fastest on a CPU, "
                   f"compiled at first use; torch: the reference) (default: {DEFAULT_ATTENTION_BACKEND})")


def build_server(model: str, policy: str, config=None, *, device: str = "cpu",
                 dtype="float32", draft_model: str | None = None, served_model_name: str | None = None,
                 max_num_waiting: int = 256, keep_history: bool = False, loaded=None, attention_backend="torch",
                 max_body_bytes: int = 8 << 20, start: bool = True, enforce_eager: bool = False):
    """(FastAPI app, AsyncEngine) for ``model`` under ``policy``; the engine loop is started in a thread of its
    own, or with ``start=False`` not (``AsyncEngine.run_in_this_thread`` runs it).

    config: the policy's settings, a dict or its config object (as ``make_engine``'s ``config``).

    dtype: a torch dtype or a ``--dtype`` name ("auto": bfloat16 where it is fast); ignored with ``loaded``.
    loaded: an already loaded (model, tokenizer) pair to serve (tests and notebooks share one).
    attention_backend: a registered attention backend's name (``runner.backends``) or an AttentionBackend; the
        reference "torch" by default here (tests compare against it), "sdpa" for ``serve`` (DEFAULT_ATTENTION_BACKEND).
    max_body_bytes: the largest request body (bytes); a larger one is answered 413.
    enforce_eager: no CUDA graphs for the decode steps on a GPU (``ModelRunner``'s option).

    Raises:
        ValueError: an unknown model or policy, a policy that cannot serve (the HF baselines), an option out of
            range or one the policy does not use, an unknown attention backend, a KV cache too big for memory.
    """
    from minibatch.experiment import check_draft_model, default_draft, load_draft_runner
    from minibatch.policies import POLICIES, get_policy, make_engine
    from minibatch.runner import ModelRunner
    from minibatch.serving.server import build_app

    if policy not in POLICIES:
        raise ValueError(f"--policy must be one of {', '.join(POLICIES)} (the engine's policies), got {policy!r}")
    check_draft_model(draft_model, (policy,))
    if loaded is None:
        from minibatch.models import check_model_name, load_model

        check_model_name(model, "--model")
        loaded = load_model(model, device=device, dtype=dtype)
    hf_model, tokenizer = loaded
    runner = ModelRunner(hf_model, tokenizer, attention_backend=attention_backend, enforce_eager=enforce_eager)
    draft_runner = None
    if get_policy(policy).proposer == "draft":
        draft_runner = load_draft_runner(draft_model or default_draft(model), model, hf_model, tokenizer, device,
                                         attention_backend, enforce_eager)
    new_engine = lambda: make_engine(policy, runner, LiveClock(device), config=config, draft_runner=draft_runner)
    warm_up(new_engine())  # a throwaway engine's forwards take the model's one-time costs, before any user's
    engine = new_engine()
    name = served_model_name or model
    metrics = ServingMetrics(name)
    async_engine = AsyncEngine(engine, max_num_waiting, keep_history=keep_history, on_step=metrics.on_step)
    app = build_app(async_engine, tokenizer, name, metrics, max_body_bytes)
    return app, async_engine.start() if start else async_engine


def build_in_engine_thread(build: Callable[[], tuple], threads: int) -> tuple:
    """Call ``build`` (returning (app, AsyncEngine not started)) in a new thread with ``threads`` torch threads,
    which then runs the engine's loop: every torch operation of the server, loading included, runs in that one
    thread (``AsyncEngine.run_in_this_thread`` says why). Returns build's result once it is built.

    Raises:
        whatever ``build`` raised (an unknown model or policy, an option out of range, ...)."""
    import torch

    built: dict = {}
    ready = threading.Event()

    def engine_thread():
        try:
            torch.set_num_threads(threads)
            built["result"] = build()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
            built["error"] = e
        finally:
            ready.set()
        if "result" in built:
            built["result"][1].run_in_this_thread()

    threading.Thread(target=engine_thread, name="minibatch-engine", daemon=True).start()
    ready.wait()
    if "error" in built:
        raise built["error"]
    return built["result"]


def run_serve(args, settings: dict) -> int:
    """``python -m minibatch serve``: load, start the engine, serve until Ctrl-C. settings: the
    policy's settings given on the command line (any the policy does not have is refused)."""
    import torch

    from minibatch.checks import check_int, check_real, short_repr
    from minibatch.experiment import check_policy_settings
    from minibatch.machine import check_listen_address
    from minibatch.policies import POLICIES
    from minibatch.serving.connections import server_config

    check_int(args.port, "--port", 1, 65535)
    check_int(args.threads, "--threads", 1, 1024)
    check_int(args.max_num_waiting, "--max-num-waiting", 1, 1 << 20)
    check_listen_address(args.host, args.port)  # before the model loads, not after "serving on ..."
    if (name := args.served_model_name) is not None and not name.strip():
        raise ValueError(f"--served-model-name must be a non-empty id (omit it for --model's), got {short_repr(name)}")
    check_int(args.max_body_bytes, "--max-body-bytes", 1024, 1 << 31)
    check_real(args.drain_timeout_s, "--drain-timeout-s", 0.0, 86400.0)
    if args.policy in POLICIES:  # (python -m minibatch loads --policy-module files first; build_server
        settings = check_policy_settings(settings, (args.policy,), tuple(POLICIES))  # names an unknown policy)
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, args.device)
    app, engine = build_in_engine_thread(lambda: build_server(
        args.model, args.policy, settings, device=args.device, dtype=dtype, draft_model=args.draft_model,
        served_model_name=args.served_model_name, max_num_waiting=args.max_num_waiting, start=False,
        attention_backend=args.attention_backend, max_body_bytes=args.max_body_bytes, enforce_eager=args.enforce_eager),
        args.threads)
    if app.state.context.tokens < 2:  # not even a 1-token prompt and 1 output token: every request would fail
        engine.shutdown()
        raise ValueError("no request fits this server's KV cache (not even a 1-token prompt with 1 output token): "
                         "give it more (--n-slots)")
    print(f"serving {args.served_model_name or args.model} ({dtype_name(dtype)}) under {args.policy}, "
          f"{app.state.context}, on http://{args.host}:{args.port}/v1", flush=True)
    server = draining_server(server_config(app, args.host, args.port, log_level="warning",
                                           timeout_graceful_shutdown=10), engine, args.drain_timeout_s)
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0


def draining_server(config, engine: AsyncEngine, drain_timeout_s: float):
    """uvicorn's server (for ``config``) with a graceful drain: the first SIGTERM/SIGINT stops new requests (503),
    lets the open ones finish for up to ``drain_timeout_s``, ends the rest with finish_reason "abort" (each open
    stream gets its final chunk and ``[DONE]``), then uvicorn closes the connections; a second signal exits at once."""
    import uvicorn

    class Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame):
            if self.draining:  # a second signal: uvicorn's own (force) exit
                return super().handle_exit(sig, frame)
            self.draining = True
            print(f"draining: no new requests; open ones get up to {drain_timeout_s:g} s", flush=True)
            threading.Thread(target=self._drain, args=(sig, frame), name="minibatch-drain", daemon=True).start()

        def _drain(self, sig, frame):
            left = engine.drain(drain_timeout_s)
            engine.shutdown()  # the open streams end with finish_reason "abort"
            print(f"drained; {left} request(s) ended with finish_reason 'abort'", flush=True)
            time.sleep(0.2)  # their final events reach the sockets before uvicorn starts closing
            super().handle_exit(sig, frame)

    return Server(config)
