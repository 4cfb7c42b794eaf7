"""``round_robin``: replicas in turn, whatever their load (the baseline every router is compared with)."""

from minibatch.cluster.routers.base import Router, register_router


@register_router
class RoundRobin(Router):
    name = "round_robin"
    description = "replicas in turn, whatever their load"

    def __init__(self):
        self.next = {}  # role -> the index after the replica last chosen for it (disaggregated: prefill, decode)

    def route(self, request, replicas, now_s):
        # the next replica in index order among those that may take it (all of one role), in turn per role
        role = replicas[0].role
        chosen = min(replicas, key=lambda r: (r.index - self.next.get(role, 0)) % (1 << 30))
        self.next[role] = chosen.index + 1
        return chosen
