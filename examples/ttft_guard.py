"""An SLO-aware variant of chunked prefill: decodes first, unless a waiting request's TTFT is at risk.

    python -m minibatch compare --policy-module examples/ttft_guard.py --policies chunked,ttft_guard \
        [--guard-ttft-s 1.0]

Sarathi-Serve's stall-free batching (OSDI'24) serves running decodes first and fills the rest of
the token budget with prefill chunks, so ITL stays low; under load a new request can wait many
steps for its first token. This policy watches the waiting queue: when a request has waited more
than ``guard_ttft_s`` (its own setting, ``--guard-ttft-s``), the step admits and prefills waiting
requests first and the decodes share what is left of the budget (a prefill-first step, as vLLM v0
ran). Otherwise it is plain chunked prefill. The trade: TTFT tail down, ITL tail up.

The default, 1 s, is half the TTFT objective ``compare`` counts goodput against (``--slo-ttft-s``, 2 s).
"""

from dataclasses import dataclass

from minibatch import register_policy
from minibatch.config import option
from minibatch.scheduler import ChunkedPrefillScheduler, SchedulerOutput
from minibatch.scheduler.config import ChunkedConfig


@dataclass(frozen=True)
class TTFTGuardConfig(ChunkedConfig):
    """Chunked prefill's settings plus the guard's."""

    guard_ttft_s: float = option(1.0, "prefill first once a waiting request has waited this long, s", "real",
                                 low=0.0, high=3600.0, low_open=True)


class TTFTGuard(ChunkedPrefillScheduler):
    """Chunked prefill that turns prefill-first for a step when a waiting request nears its TTFT SLO."""

    name = "ttft_guard"
    config_cls = TTFTGuardConfig

    @classmethod
    def from_config(cls, config: TTFTGuardConfig, **kwargs) -> "TTFTGuard":
        return super().from_config(config, guard_ttft_s=config.guard_ttft_s, **kwargs)

    def __init__(self, *args, guard_ttft_s: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.guard_ttft_s = guard_ttft_s
        self.num_guard_steps = 0  # steps that ran prefill-first

    def make_stats(self) -> dict:  # the run's row (compare's and simulate's JSON) gets the guard's count
        return super().make_stats() | {"num_guard_steps": self.num_guard_steps}

    def schedule(self, now_s: float) -> SchedulerOutput:
        at_risk = any(now_s - r.arrival_time_s > self.guard_ttft_s for r in self.waiting)
        if not at_risk or self.swapped:  # swapped-out requests come back first, as in the base policy
            return super().schedule(now_s)
        self.num_guard_steps += 1
        out = self.begin_step()
        self.schedule_waiting(out)  # prefills first (as many as fit the budget and the free blocks)
        self.schedule_running(out)  # then the decodes, with the budget left
        return self.finish_output(out)


register_policy("ttft_guard", TTFTGuard, description="chunked prefill, prefill-first when a TTFT is at risk",
                improves_on="chunked")
