"""Orca: iteration-level scheduling (Yu et al., "Orca: A Distributed Serving System for
Transformer-Based Generative Models", OSDI'22, §4.2 and Algorithm 1).

Algorithm 1, for one engine (no pipeline, so every admitted request runs every iteration):

    Select(pool, n_rsrv):
        batch = {}
        for req in sortByArrivalTime(pool):           # FCFS
            if batch.size == max_num_seqs: break
            if req.state == INITIATION:               # not admitted yet
                new_n_rsrv = n_rsrv + req.max_tokens  # prompt + max_new_tokens
                if new_n_rsrv > n_slots: break        # no skipping ahead: FCFS
                n_rsrv = new_n_rsrv
            batch = batch ∪ {req}
        return batch, n_rsrv

Which max_tokens? On our traces a request's max_new_tokens is exactly its output length
(ignore_eos), so by default Orca reserves what it will really use: vLLM's "Orca (Oracle)"
baseline (Kwon et al. SOSP'23 §6.1). A real server cannot know when EOS comes; it reserves up to
its cap on max_tokens: pass ``reserve_new_tokens`` = that cap for vLLM's "Orca (Max)".

Reserving max_tokens slots at admission means a running request never runs out of KV memory
mid-generation (Orca §4.2); the price is reserved-but-unused slots, which paged KV removes.
A request's slots are released when it finishes, and new requests join at any iteration.
"""

from __future__ import annotations

from minibatch.kv.block_manager import BlockManager
from minibatch.request import Request, RequestStatus
from minibatch.scheduler.base import Scheduler, SchedulerOutput, StepResult
from minibatch.scheduler.output import ScheduledRequest
from minibatch.scheduler.config import OrcaConfig


class OrcaScheduler(Scheduler):
    """Iteration-level scheduler with Orca's max-length KV reservation.

    Args:
        max_num_seqs: the most requests in one batch (vLLM's max_num_seqs), >= 1.
        n_slots: KV cache capacity in token slots, >= 1.
        block_size: slots per KV block (1 = Orca's per-token reservation, exactly Alg. 1).
            With block_size > 1 a reservation is rounded up to whole blocks and n_rsrv counts
            the rounded slots; n_slots is rounded down to whole blocks.
        reserve_new_tokens: reserve prompt + max(max_new_tokens, this) per request ("Orca (Max)"
            with this cap); None reserves prompt + max_new_tokens ("Orca (Oracle)" on our traces).
        queue_policy: "fcfs" (Algorithm 1's sortByArrivalTime, default), "sjf", "priority" or a
            QueuePolicy: the order waiting requests are considered in (still no skipping ahead).

    Raises:
        ValueError: a bad argument; ``check_request`` for a request larger than n_slots.
    """

    name = "orca"
    config_cls = OrcaConfig

    @classmethod
    def from_config(cls, config) -> "OrcaScheduler":
        return cls(max_num_seqs=config.max_num_seqs, n_slots=config.n_slots, block_size=config.block_size,
                   reserve_new_tokens=config.reserve_new_tokens, queue_policy=cls.queue_policy_from(config))

    def __init__(self, max_num_seqs: int = 8, n_slots: int = 16384, block_size: int = 1,
                 reserve_new_tokens: int | None = None, queue_policy="fcfs"):
        super().__init__(queue_policy)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if n_slots < block_size:
            raise ValueError(f"n_slots must be >= block_size ({block_size}), got {n_slots}")
        if reserve_new_tokens is not None and reserve_new_tokens < 1:
            raise ValueError(f"reserve_new_tokens must be >= 1 or None, got {reserve_new_tokens}")
        self.max_num_seqs = max_num_seqs
        self.reserve_new_tokens = reserve_new_tokens
        self.block_manager = BlockManager(n_slots // block_size, block_size)
        self.n_slots = self.block_manager.num_slots
        self.n_rsrv = 0

    def _reservation_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens + max(request.max_new_tokens, self.reserve_new_tokens or 0)

    def _reservation(self, request: Request) -> int:
        return self.block_manager.num_blocks_for(self._reservation_tokens(request)) * self.block_manager.block_size

    def check_request(self, request: Request) -> None:
        if self._reservation(request) > self.n_slots:
            raise ValueError(
                f"request {request.request_id!r} reserves {self._reservation_tokens(request)} KV slots "
                f"(prompt + max_new_tokens, or the reserve_new_tokens cap); n_slots is {self.n_slots}"
            )

    def schedule(self, now_s: float) -> SchedulerOutput:
        # Every running request is in the batch; then waiting ones in queue-policy order
        # (FCFS: by arrival, Algorithm 1's sortByArrivalTime), stopping at the first that does not fit.
        batch = list(self.running)
        self.waiting.sort(key=self.sort_key)
        while self.waiting and len(batch) < self.max_num_seqs:
            req = self.waiting[0]
            new_n_rsrv = self.n_rsrv + self._reservation(req)
            if new_n_rsrv > self.n_slots:
                break
            self.n_rsrv = new_n_rsrv
            self.waiting.pop(0)
            self.block_manager.allocate_slots(req, self._reservation_tokens(req))  # all it can ever need
            self.take_row(req.request_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.append(req)
        scheduled = [
            ScheduledRequest(
                request=r,
                num_new_tokens=r.num_tokens - r.num_computed_tokens,  # whole prompt, or 1 decode
                phase="prefill" if r.is_prefill else "decode",
                row=self.rows[r.request_id],
            )
            for r in batch
        ]
        return SchedulerOutput(
            scheduled=scheduled,
            num_idle_rows=self.max_num_seqs - len(batch),
            block_tables={r.request_id: self.block_manager.block_tables[r.request_id] for r in batch},
        )

    def update(self, plan: SchedulerOutput, result: StepResult) -> list[Request]:
        finished = self.advance(plan, result)
        for r in finished:
            self._release(r)
        return finished

    def free_kv(self, request: Request) -> None:
        """Free the reservation of a running request (a waiting one holds none)."""
        if request.request_id in self.block_manager.block_tables:
            self.block_manager.free(request.request_id)
            self.n_rsrv -= self._reservation(request)

    def _release(self, r: Request) -> None:
        self.running.remove(r)
        self.free_kv(r)
        del self.rows[r.request_id]

    @property
    def num_kv_slots_reserved(self) -> int:
        return self.n_rsrv
