"""``cache_aware``: the replica whose prefix cache already holds the longest prefix of the prompt, under the same
load bound as ``prefix_affinity``.

Each replica's scheduler is asked how many of the prompt's tokens its prefix cache holds, in full blocks (the
lookup admission makes, ``Scheduler.num_cached_prefix_tokens``: nothing counted or changed). Among the replicas
under the load bound (:func:`~minibatch.cluster.routers.base.load_bound`), the one holding the most wins; ties,
and a prompt cached nowhere: the fewest outstanding requests, then the lowest index. Unlike a hash of the first
tokens it follows a conversation from its first turn, however short, and it finds a prefix that another
conversation left. SGLang's cache-aware router and llm-d's prefix-cache scorer route on the same idea from an
estimate of what each replica holds (a radix tree of the prompts sent there); the simulator can ask the caches
themselves, so this router is what such an estimate aims at.
"""

from __future__ import annotations

from minibatch.cluster.routers.base import Router, load_bound, register_router


@register_router
class CacheAware(Router):
    name = "cache_aware"
    description = "the replica whose prefix cache holds the longest prefix of the prompt, with a load bound"
    needs = "prefix_cache"
    epsilon = 0.25

    def route(self, request, replicas, now_s):
        bound = load_bound(replicas, self.epsilon)
        under = [r for r in replicas if r.outstanding + 1 <= bound] or replicas
        return max(under, key=lambda r: (r.engine.scheduler.num_cached_prefix_tokens(request), -r.outstanding,
                                         -r.index))
