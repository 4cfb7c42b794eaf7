"""``prefix_affinity``: requests that start alike go to the same replica, so its prefix cache has their blocks;
bounded so that no replica takes far more than its share.

The key is a hash of the prompt's first ``prefix_tokens`` tokens (a conversation's system prompt and first turn:
every later turn of the conversation starts with them). A first prompt shorter than that hashes differently from
the turns after it, whose first ``prefix_tokens`` tokens reach into the answer; from the first turn that fills
them on, the conversation keeps one key. Replicas sit on a consistent-hashing ring (Karger et al.,
STOC'97) at ``virtual_nodes`` points each; a key goes to the first replica clockwise from it. Consistent hashing
with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA'18, §2): a replica whose outstanding requests would
exceed ``ceil((1 + epsilon) x the mean)`` is skipped for the next one on the ring, so a hot prefix spills over
instead of queueing behind itself. SGLang's cache-aware router and llm-d's prefix-aware scorer route on the same
idea (with a radix tree of what each replica holds instead of a hash of a fixed prefix).
"""

from __future__ import annotations

import bisect
import hashlib
from array import array

from minibatch.cluster.routers.base import Router, load_bound, register_router


def stable_hash(data: bytes) -> int:
    """A 64-bit hash that is the same in every process (Python's ``hash`` of bytes is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@register_router
class PrefixAffinity(Router):
    name = "prefix_affinity"
    description = "consistent hashing on the prompt's first tokens, with a load bound"
    prefix_tokens = 64
    virtual_nodes = 64
    epsilon = 0.25

    def __init__(self):
        self._ring: list[tuple[int, int]] | None = None  # (point, replica index), sorted
        self.num_spilled = 0  # requests that went past their ring replica because of the load bound

    def ring(self, num_replicas: int) -> list[tuple[int, int]]:
        if self._ring is None or len({i for _, i in self._ring}) != num_replicas:
            self._ring = sorted((stable_hash(f"replica-{i}-{v}".encode()), i)
                                for i in range(num_replicas) for v in range(self.virtual_nodes))
        return self._ring

    def route(self, request, replicas, now_s):
        by_index = {r.index: r for r in replicas}
        total = max(r.index for r in replicas) + 1
        ring = self.ring(total)
        key = stable_hash(array("q", request.prompt_token_ids[: self.prefix_tokens]).tobytes())
        bound = load_bound(replicas, self.epsilon)
        start = bisect.bisect(ring, (key, total))
        first = None
        for k in range(len(ring)):
            replica = by_index.get(ring[(start + k) % len(ring)][1])
            if replica is None:
                continue  # not eligible now (its role, or the admission limit)
            first = first or replica
            if replica.outstanding + 1 <= bound:
                self.num_spilled += replica is not first
                return replica
        return first
