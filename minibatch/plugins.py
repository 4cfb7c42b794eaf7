"""A researcher's own policies, attention backends and routers, in a Python file of theirs loaded with
``--policy-module FILE.py`` (``compare``, ``simulate``, ``serve``, ``sweep``'s ``policy_module``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def registries() -> dict[str, dict]:
    """The tables a plug-in file registers into: kind -> {name: what is registered}."""
    from minibatch.cluster.routers.base import ROUTERS
    from minibatch.policies import POLICIES
    from minibatch.runner.backends.base import BACKENDS
    from minibatch.scheduler.queue_policy import QUEUE_POLICIES

    return {"policy": POLICIES, "attention backend": BACKENDS, "router": ROUTERS, "queue policy": QUEUE_POLICIES}


def load_policy_module(path: str) -> list[str]:
    """Run the Python file ``path`` (a researcher's policy: a scheduler subclass and a ``register_policy`` call; an
    attention backend and a ``register_backend`` call; a router and ``register_router``; a queue policy and
    ``register_queue_policy``); returns the names it
    registered. A relative path is read from the current directory. The same file unchanged is run once per
    process; after an edit (a newer modification time) it runs again and its new definitions replace the ones it
    registered before (a notebook cell, or a sweep, picks up the edit without a restart).

    Raises:
        ValueError: no such .py file, the file fails to import (its error in one line), or it
            registers no policy, attention backend, router or queue policy.
    """
    file = Path(path)
    if file.suffix != ".py" or not file.is_file():
        raise ValueError(f"--policy-module: {'not a .py file' if file.is_file() else 'no such Python file'} {path!r}")
    tables = registries()
    resolved, mtime = file.resolve(), file.stat().st_mtime_ns
    earlier = _LOADED.get(resolved)
    if earlier and earlier[0] == mtime and all(any(name in t for t in tables.values()) for name in earlier[1]):
        return earlier[1]  # loaded already (a notebook cell run again, compare then simulate in one process)
    if earlier:  # an edited file: what it registered before gives way to its new definitions
        for name in earlier[1]:
            for table in tables.values():
                table.pop(name, None)
    before = {kind: dict(table) for kind, table in tables.items()}
    spec = importlib.util.spec_from_file_location(f"minibatch_policy_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a plug-in's own bug: one line naming the file
        raise ValueError(f"--policy-module {path}: {type(e).__name__}: {e}") from None
    added = list(dict.fromkeys(name for kind, table in tables.items() for name, obj in table.items()
                               if before[kind].get(name) is not obj))
    if not added:
        raise ValueError(f"--policy-module {path}: registers no policy (call minibatch.register_policy), attention "
                         "backend (minibatch.runner.backends.register_backend), router "
                         "(minibatch.cluster.routers.register_router) or queue policy "
                         "(minibatch.scheduler.register_queue_policy)")
    _LOADED[resolved] = (mtime, added)
    return added


_LOADED: dict[Path, tuple[int, list[str]]] = {}  # resolved path -> (its mtime when run, what it registered)
