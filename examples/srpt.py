"""Shortest remaining processing time (SRPT) with preemption, as a plug-in policy.

    python -m minibatch compare --policy-module examples/srpt.py --policies srpt,paged --max-num-seqs 4

The running request with the most work left yields to a waiting one with less: when every batch
row is taken (max_num_seqs), the waiting request with the fewest tokens left preempts the
running request with the most (the engine's own preemption: recompute or swap). Every queue is
served shortest-remaining first. SRPT minimizes mean response time on a single server (Schrage,
Operations Research 1968); its price is that long requests wait, and can be preempted again.

Work left is counted in steps: the output tokens still to generate (a prefill, however long, is
one step). Output lengths come from the trace here (requests ignore EOS), an oracle; a server
would use a predicted length.
"""

from dataclasses import dataclass

from minibatch import register_policy
from minibatch.config import option
from minibatch.scheduler import PagedScheduler, QueuePolicy, SchedulerOutput
from minibatch.scheduler.config import PagedConfig


class RemainingTokens(QueuePolicy):
    """Fewest output tokens left first (each is one decode step)."""

    name = "remaining"

    def key(self, request) -> tuple:
        return (request.max_new_tokens - request.num_output_tokens,)


@dataclass(frozen=True)
class SRPTConfig(PagedConfig):
    """The paged scheduler's settings; the order of service is SRPT's own (any other is refused)."""

    queue_policy: str = option("remaining", "order of service: fewest output tokens left first", "choice",
                               choices=("remaining",))


class ShortestRemainingFirst(PagedScheduler):
    """A paged scheduler that serves shortest-remaining first and preempts for shorter arrivals."""

    name = "srpt"
    config_cls = SRPTConfig

    @classmethod
    def queue_policy_from(cls, config: SRPTConfig) -> QueuePolicy:
        return RemainingTokens()

    def schedule_running(self, out: SchedulerOutput) -> None:
        # Before the running requests get their tokens: while the batch is full and a waiting
        # request has less left than the longest running one, that one gives up its row.
        # (Admission waits for the next step: a step that preempts admits nobody.)
        while self.waiting and len(self.running) >= self.max_num_seqs:
            shortest = min(self.waiting, key=self.sort_key)
            longest = max(self.running, key=self.sort_key)
            if self.queue_policy.key(shortest) >= self.queue_policy.key(longest):
                break
            self.preempt(longest, out)
        super().schedule_running(out)


register_policy("srpt", ShortestRemainingFirst, description="paged, shortest remaining first, preempting",
                improves_on="paged")
