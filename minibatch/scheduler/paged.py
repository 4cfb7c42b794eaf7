"""Paged scheduling: iteration-level batching over a paged KV cache (vLLM, Kwon et al. SOSP'23,
§4.2-§4.5; the vLLM v0 scheduler).

Orca reserves prompt + max_new_tokens slots per request at admission; here a request gets blocks
only as it needs them, so admission asks "are there free blocks for this prompt?" and many more
requests fit in the same memory. The price: a running request may find no free block for its
next token. Then the scheduler *preempts* (§4.5) the most recently admitted request, either by

* ``recompute``: free its blocks and put it back at the front of the waiting queue; when it is
  admitted again it prefills its prompt *and* the tokens it already generated, in one step; or
* ``swap``: copy its blocks to CPU memory, and copy them back when blocks free up.

One step:

    1. running requests, oldest first: make room for each one's next token, preempting from
       the newest end (latest arrival) while there is none;
    2. if nothing was preempted: swapped-out requests come back (oldest first);
    3. if nothing was preempted and nobody is swapped out: admit waiting requests FCFS while
       their prompt fits above the watermark (prefix-cache hits need no new blocks; a parallel
       sample forks its parent's prompt blocks).

No request is lost or duplicated: a request is always in exactly one of waiting, running or
swapped until it finishes.
"""

from __future__ import annotations

from minibatch.kv.block_manager import BlockManager
from minibatch.request import Request, RequestStatus
from minibatch.scheduler.base import ScheduledRequest, Scheduler, SchedulerOutput

PREEMPTION_MODES = ("recompute", "swap")


class PagedScheduler(Scheduler):
    """vLLM-style iteration-level scheduler with on-demand KV blocks.

    Args:
        max_bs: the most running requests (vLLM's max_num_seqs), >= 1.
        num_blocks: KV blocks (n_slots = num_blocks * block_size), >= 1.
        block_size: token slots per block, >= 1.
        enable_prefix_caching: reuse cached full prompt blocks across requests.
        preemption_mode: "recompute" or "swap".
        num_cpu_blocks: CPU blocks for swapping (default num_blocks when swapping, else 0). If
            they run out, a swap preemption falls back to recompute.
        watermark: fraction of blocks admission leaves free, in [0, 1).

    Raises:
        ValueError: a bad argument; ``check_request`` for a request that cannot fit alone.
    """

    name = "paged"

    def __init__(self, max_bs: int = 8, num_blocks: int = 256, block_size: int = 16, *,
                 enable_prefix_caching: bool = False, preemption_mode: str = "recompute",
                 num_cpu_blocks: int | None = None, watermark: float = 0.01):
        super().__init__()
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if num_cpu_blocks is None:
            num_cpu_blocks = num_blocks if preemption_mode == "swap" else 0
        self.max_bs = max_bs
        self.preemption_mode = preemption_mode
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                          watermark=watermark, num_cpu_blocks=num_cpu_blocks)
        self.swapped: list[Request] = []
        self.num_preemptions = 0
        self._arrival_order: dict[str, int] = {}  # request_id -> order of arrival (FCFS priority)
        if enable_prefix_caching:
            self.name = "paged_prefix"

    # ------------------------------------------------------------------ admission checks
    def check_request(self, request: Request) -> None:
        bm = self.block_manager
        usable = bm.num_blocks - bm.watermark_blocks
        if bm.num_blocks_for(request.max_num_tokens) > usable:
            raise ValueError(
                f"request {request.request_id!r} needs {bm.num_blocks_for(request.max_num_tokens)} KV blocks "
                f"(prompt + max_new_tokens = {request.max_num_tokens} tokens, block_size {bm.block_size}); "
                f"only {usable} blocks are usable (num_blocks {bm.num_blocks} minus the watermark)"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add_request(self, request: Request) -> None:
        self._arrival_order[request.request_id] = len(self._arrival_order)
        super().add_request(request)

    # ------------------------------------------------------------------ one step
    def schedule(self, now_s: float) -> SchedulerOutput:
        bm = self.block_manager
        out = SchedulerOutput()
        batch: list[Request] = []

        # 1. running requests: room for each one's new tokens, preempting the newest if needed.
        # "Newest" is by arrival (vLLM v0's FCFS priority): a request preempted and admitted again
        # keeps its place, or it would be the next victim every time and starve.
        self.running.sort(key=lambda r: self._arrival_order[r.request_id])
        queue = list(self.running)
        while queue:
            req = queue.pop(0)
            while (copies := bm.allocate_slots(req, req.num_tokens - req.num_computed_tokens)) is None:
                victim = queue.pop() if queue else req  # the latest arrival still running
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.blocks_to_copy += copies
                batch.append(req)

        # 2. swapped-out requests come back first (they arrived before anyone waiting)
        while not out.preempted and self.swapped and len(self.running) < self.max_bs:
            req = self.swapped[0]
            if not bm.can_swap_in(req):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in += bm.swap_in(req.request_id)
            out.blocks_to_copy += bm.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
            self._run(req)
            batch.append(req)

        # 3. admit waiting requests, FCFS, no skipping ahead
        while not out.preempted and not self.swapped and self.waiting and len(self.running) < self.max_bs:
            req = self.waiting[0]
            copies = self._admit(req)
            if copies is None:
                break
            self.waiting.pop(0)
            out.blocks_to_copy += copies
            self._run(req)
            batch.append(req)

        for req in batch:
            n = req.num_tokens - req.num_computed_tokens
            out.scheduled.append(ScheduledRequest(
                request=req, num_new_tokens=n, phase="prefill" if n > 1 or req.is_prefill else "decode",
                slot=self.slots[req.request_id]))
        out.num_idle_slots = self.max_bs - len(batch)
        out.block_tables = {r.request_id: bm.block_tables[r.request_id] for r in batch}
        return out

    def _admit(self, req: Request) -> list[tuple[int, int]] | None:
        """Give a waiting request its blocks (fork, prefix-cache hits, new blocks); None if they
        do not fit (nothing changed then)."""
        bm = self.block_manager
        parent = self._running_parent(req)
        if parent is not None:  # parallel sampling: share the parent's prompt blocks
            if parent.num_computed_tokens < parent.num_prompt_tokens:
                return None  # the parent's prompt is not computed yet: wait one step (FCFS)
            bm.fork(parent.request_id, req.request_id, req.num_prompt_tokens)
            req.num_computed_tokens = req.num_prompt_tokens - 1  # sample its own first token
            copies = bm.allocate_slots(req, req.num_tokens - req.num_computed_tokens, use_watermark=True)
            if copies is None:
                bm.free(req.request_id)
                req.num_computed_tokens = 0
            return copies
        hits = bm.get_computed_blocks(req)
        req.num_computed_tokens = len(hits) * bm.block_size
        copies = bm.allocate_slots(req, req.num_tokens - req.num_computed_tokens, hits, use_watermark=True)
        if copies is None:
            req.num_computed_tokens = 0
        else:
            bm.record_prefix_hits(req, hits)
        return copies

    def _running_parent(self, req: Request) -> Request | None:
        if req.parent_request_id is None:
            return None
        for r in self.running:
            if r.request_id == req.parent_request_id and r.prompt_token_ids == req.prompt_token_ids:
                return r
        return None

    def _run(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.take_slot(req.request_id)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Take ``req`` off the running list: swap its KV out, or free it for recompute."""
        bm = self.block_manager
        self.running.remove(req)
        del self.slots[req.request_id]
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
        if self.preemption_mode == "swap" and bm.can_swap_out(req.request_id):
            out.blocks_to_swap_out += bm.swap_out(req.request_id)
            req.status = RequestStatus.SWAPPED
            self._insert_by_arrival(self.swapped, req)
        else:
            bm.free(req.request_id)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self._insert_by_arrival(self.waiting, req)  # ahead of every later arrival

    def _insert_by_arrival(self, queue: list[Request], req: Request) -> None:
        order = self._arrival_order
        i = next((i for i, r in enumerate(queue) if order[r.request_id] > order[req.request_id]), len(queue))
        queue.insert(i, req)

    # ------------------------------------------------------------------ after the forward
    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        finished = self.advance(output, sampled)
        for s in output.scheduled:
            self.block_manager.cache_full_blocks(s.request)
        for r in finished:
            self.running.remove(r)
            self.block_manager.free(r.request_id)
            del self.slots[r.request_id]
        return finished

    # ------------------------------------------------------------------ accounting
    @property
    def num_kv_slots_used(self) -> int:
        """Physical KV slots holding computed tokens (a block shared by several requests counts once)."""
        return self.block_manager.num_slots_used(self.running)

    @property
    def num_kv_slots_reserved(self) -> int:
        """Slots of every block in use: the last block's empty slots are internal fragmentation."""
        return self.block_manager.num_used_blocks * self.block_manager.block_size
