"""The router interface and the registry of routers by name (see the package docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from minibatch.request import Request


@dataclass
class Replica:
    """One engine of a cluster as a router sees it.

    index: its position in the cluster; engine: the :class:`~minibatch.engine.Engine` (its scheduler, block manager
    and clock); role: "both" (colocated), "prefill" or "decode" (disaggregated); outstanding: requests routed here
    and not yet finished (vLLM's production stack and SGLang's router call this the replica's load).
    """

    index: int
    engine: object
    role: str = "both"
    outstanding: int = 0
    routed: int = 0  # requests ever routed here

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued here and not running (arrived or not yet, preempted, swapped)."""
        s = self.engine.scheduler
        return len(s.waiting) + len(s.swapped) + len(self.engine.pending)

    @property
    def kv_usage(self) -> float:
        """The share of its KV blocks in use, in [0, 1] (0 for a scheduler without a block manager)."""
        return self.engine.scheduler.kv_cache_usage()


class Router:
    """Chooses a replica for each request. ``name``: the registry key (``--router NAME``); ``description``: one line.

    ``route`` gets the request and the replicas that may take it (those under the cluster's admission limit, of the
    right role), never an empty list, and returns one of them. It may keep state (a round-robin counter, a hash
    ring); a fresh router is made for every run (:func:`get_router` returns a new instance). ``needs``: what it
    reads from the replicas ("prefix_cache": their prefix caches; "kv_cache": their block managers), so a cluster
    whose policy has none refuses it instead of routing by its tie-breaks alone."""

    name: str = ""
    description: str = ""
    needs: str | None = None  # "prefix_cache" or "kv_cache": what of the replicas it reads (Cluster checks it)

    def route(self, request: Request, replicas: list[Replica], now_s: float) -> Replica:
        raise NotImplementedError


def load_bound(replicas: list[Replica], epsilon: float) -> int:
    """The most outstanding requests a replica may have after taking one more: ceil((1 + epsilon) x the mean over
    ``replicas`` with that request counted), consistent hashing with bounded loads (Mirrokni, Thorup,
    Zadimoghaddam, SODA'18, §2). At least one replica is always under it (the least loaded)."""
    return math.ceil((1 + epsilon) * (sum(r.outstanding for r in replicas) + 1) / len(replicas))


ROUTERS: dict[str, type[Router]] = {}  # name -> Router class, like the policy table POLICIES


def register_router(cls: type[Router]) -> type[Router]:
    """Add a Router subclass to the registry under ``cls.name`` (usable as a class decorator); returns it.

    Raises:
        ValueError: no name, or the name is registered already by another class."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in ROUTERS and ROUTERS[cls.name].__qualname__ != cls.__qualname__:
        raise ValueError(f"router {cls.name!r} is registered already")
    ROUTERS[cls.name] = cls
    return cls


def router_names() -> tuple[str, ...]:
    return tuple(ROUTERS)


def get_router(name: str) -> Router:
    """A new instance of the router called ``name``.

    Raises:
        ValueError: no router of that name (the message lists the registered ones)."""
    if name not in ROUTERS:
        raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {name!r}")
    return ROUTERS[name]()
