"""Routers: how a cluster of replicas (``minibatch.cluster``) picks the replica for each request, one class per
file, registered by name like the policy table and the attention backends.

Built in: ``round_robin``, ``least_outstanding`` (fewest unfinished requests), ``least_kv`` (lowest KV cache
usage), ``prefix_affinity`` (consistent hashing on the prompt's first tokens, with a load bound) and
``cache_aware`` (the replica whose prefix cache holds the longest prefix of the prompt, with the same bound).
Adding one is one file: subclass :class:`Router`, decorate it with :func:`register_router`, and pass its name as
``--router`` (a ``--policy-module`` file may register it).
"""

from minibatch.cluster.routers.base import ROUTERS, Replica, Router, get_router, register_router, router_names
from minibatch.cluster.routers import round_robin, least_outstanding, least_kv, prefix_affinity  # the built-ins
from minibatch.cluster.routers import cache_aware  # registered last: the order --help lists them in

__all__ = ["ROUTERS", "Replica", "Router", "get_router", "register_router", "router_names", "cache_aware",
           "least_kv", "least_outstanding", "prefix_affinity", "round_robin"]
