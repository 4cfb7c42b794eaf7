"""``round_robin``: replicas in turn, whatever their load (the baseline every router is compared with)."""

from minibatch.cluster.routers.base import Router, register_router


@register_router
class RoundRobin(Router):
    name = "round_robin"
    description = "replicas in turn, whatever their load"

    def __init__(self):
        self.next = 0

    def route(self, request, replicas, now_s):
        # the next replica in index order among those that may take it
        chosen = min(replicas, key=lambda r: (r.index - self.next) % (1 << 30))
        self.next = chosen.index + 1
        return chosen
