"""A researcher's own policies, attention backends and routers, in a Python file of theirs loaded with
``--policy-module FILE.py`` (``compare``, ``simulate``, ``serve``, ``sweep``'s ``policy_module``)."""

from __future__ import annotations

import hashlib
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
    process; after an edit (other content) what it registered gives way (a name it took from another, a built-in
    it replaced, comes back) and it runs again (a notebook cell, or a sweep, picks up the edit without a restart).
    A file that fails leaves nothing of it registered.

    Raises:
        ValueError: no such .py file, the file fails to import (its error in one line), or it
            registers no policy, attention backend, router or queue policy.
    """
    file = Path(path)
    if file.suffix != ".py" or not file.is_file():
        raise ValueError(f"--policy-module: {'not a .py file' if file.is_file() else 'no such Python file'} {path!r}")
    tables = registries()
    resolved, digest = file.resolve(), hashlib.sha256(file.read_bytes()).hexdigest()
    earlier = _LOADED.pop(resolved, None)
    if earlier and earlier[0] == digest and all(name in tables[kind] for kind, name, _ in earlier[1]):
        _LOADED[resolved] = earlier
        return [name for _, name, _ in earlier[1]]  # loaded already (a notebook cell run again, compare then simulate)
    for kind, name, previous in earlier[1] if earlier else ():  # edited: what it replaced comes back, then it runs
        if previous is None:
            tables[kind].pop(name, None)
        else:
            tables[kind][name] = previous
    before = {kind: dict(table) for kind, table in tables.items()}
    spec = importlib.util.spec_from_file_location(f"minibatch_policy_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a plug-in's own bug: one line naming the file, and nothing of it left registered
        for kind, table in tables.items():
            table.clear()
            table.update(before[kind])
        raise ValueError(f"--policy-module {path}: {type(e).__name__}: {e}") from None
    added = [(kind, name, before[kind].get(name)) for kind, table in tables.items() for name, obj in table.items()
             if before[kind].get(name) is not obj]
    if not added:
        raise ValueError(f"--policy-module {path}: registers no policy (call minibatch.register_policy), attention "
                         "backend (minibatch.runner.backends.register_backend), router "
                         "(minibatch.cluster.routers.register_router) or queue policy "
                         "(minibatch.scheduler.register_queue_policy)")
    _LOADED[resolved] = (digest, added)
    return list(dict.fromkeys(name for _, name, _ in added))


# resolved path -> (its content's sha256 when run, (table, name, what that name held before) for each it registered)
_LOADED: dict[Path, tuple[str, list[tuple]]] = {}
