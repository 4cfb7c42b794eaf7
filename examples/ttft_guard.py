"""An SLO-aware variant of chunked prefill: decodes first, unless a waiting request's TTFT is at risk.

    python -m minibatch compare --policy-module examples/ttft_guard.py --policies chunked,ttft_guard

Sarathi-Serve's stall-free batching (OSDI'24) serves running decodes first and fills the rest of
the token budget with prefill chunks, so ITL stays low; under load a new request can wait many
steps for its first token. This policy watches the waiting queue: when a request has waited more
than ``GUARD_FRACTION`` of the TTFT objective, the step admits and prefills waiting requests first
and the decodes share what is left of the budget (a prefill-first step, as vLLM v0 ran). Otherwise
it is plain chunked prefill. The trade: TTFT tail down, ITL tail up.

TTFT_SLO_S is the same objective ``compare`` counts goodput against (``--slo-ttft-s``, 2 s).
"""

from minibatch import register_policy
from minibatch.scheduler import ChunkedPrefillScheduler, SchedulerOutput

TTFT_SLO_S = 2.0
GUARD_FRACTION = 0.5  # act when a request has waited half its TTFT objective


class TTFTGuard(ChunkedPrefillScheduler):
    """Chunked prefill that turns prefill-first for a step when a waiting request nears its TTFT SLO."""

    name = "ttft_guard"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_guard_steps = 0  # steps that ran prefill-first

    def schedule(self, now_s: float) -> SchedulerOutput:
        at_risk = any(now_s - r.arrival_time_s > GUARD_FRACTION * TTFT_SLO_S for r in self.waiting)
        if not at_risk or self.swapped:  # swapped-out requests come back first, as in the base policy
            return super().schedule(now_s)
        self.num_guard_steps += 1
        out = self.begin_step()
        self.schedule_waiting(out)  # prefills first (as many as fit the budget and the free blocks)
        self.schedule_running(out)  # then the decodes, with the budget left
        return self.finish_output(out)


register_policy("ttft_guard", TTFTGuard, description="chunked prefill, prefill-first when a TTFT is at risk")
