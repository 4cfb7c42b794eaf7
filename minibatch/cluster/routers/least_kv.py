"""``least_kv``: the replica whose KV cache has the most free blocks (the lowest usage share; ties: fewest
outstanding, then lowest index): a request lands where it is least likely to preempt others."""

from minibatch.cluster.routers.base import Router, register_router


@register_router
class LeastKV(Router):
    name = "least_kv"
    description = "the replica with the lowest KV cache usage"
    needs = "kv_cache"

    def route(self, request, replicas, now_s):
        return min(replicas, key=lambda r: (round(r.kv_usage, 6), r.outstanding, r.index))
