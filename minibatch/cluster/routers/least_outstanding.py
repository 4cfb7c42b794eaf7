"""``least_outstanding``: the replica with the fewest requests routed to it and not finished (ties: lowest index).
vLLM's production-stack router and SGLang's router balance on this count."""

from minibatch.cluster.routers.base import Router, register_router


@register_router
class LeastOutstanding(Router):
    name = "least_outstanding"
    description = "the replica with the fewest unfinished requests routed to it"

    def route(self, request, replicas, now_s):
        return min(replicas, key=lambda r: (r.outstanding, r.index))
