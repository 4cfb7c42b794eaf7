"""Paged scheduling: iteration-level batching over a paged KV cache (vLLM, Kwon et al. SOSP'23, §4.2-§4.5; the
vLLM v0 scheduler). Its step, preemption by recompute or swap, and the token budget are explained in
:mod:`minibatch.scheduler` (its docstring); subclasses change only the order of the stages."""

from __future__ import annotations

import math

from minibatch.checks import check_choice, check_int
from minibatch.config import PREEMPTION_MODES
from minibatch.kv.block_manager import BlockManager
from minibatch.request import Request, RequestStatus
from minibatch.scheduler.base import Scheduler, SchedulerOutput, StepResult
from minibatch.scheduler.output import ScheduledRequest
from minibatch.scheduler.config import PagedConfig
from minibatch.scheduler.queue_policy import QueuePolicy


class PagedScheduler(Scheduler):
    """vLLM-style iteration-level scheduler with on-demand KV blocks.

    Args:
        max_num_seqs: the most running requests (vLLM's max_num_seqs), >= 1.
        num_blocks: KV blocks (n_slots = num_blocks * block_size), >= 1.
        block_size: token slots per block, >= 1.
        enable_prefix_caching: reuse cached full prompt blocks across requests. preemption_mode: "recompute" or "swap".
        num_cpu_blocks: CPU blocks for swapping (default num_blocks when swapping, else 0). If
            they run out, a swap preemption falls back to recompute.
        watermark: fraction of blocks admission leaves free, in [0, 1).
        max_num_batched_tokens: the token budget: most tokens computed per step, >= 1, or None
            (no limit). Without chunking every request must fit it whole (prompt +
            max_new_tokens, the most a recompute prefills).
        queue_policy: "fcfs", "sjf", "priority" or a QueuePolicy: the order of service and the
            reverse order of preemption.
        num_lookahead_tokens: speculative decoding with a draft model: KV slots reserved past a
            sampling row's new tokens for the draft's K/V of the next drafts (vLLM v1's lookahead
            slots; 0 for n-gram lookup). The drafts live on the request (``spec_token_ids``): a
            decode computes 1 + its drafts, cut to the token budget and max_new_tokens.

    Raises:
        ValueError: a bad argument; ``check_request`` for a request that cannot fit alone.
    """

    name = "paged"
    receives_external_kv = True  # a request's num_external_computed_tokens arrive from elsewhere (vLLM's KV connector)
    pages_kv = True  # block tables of block_size slots: the KV block map draws them
    config_cls = PagedConfig
    chunked_prefill = False  # may a prompt be split across steps? (ChunkedPrefillScheduler)
    max_num_prefills: int | None = None  # most waiting requests admitted per step (None: no limit)

    def __init__(self, max_num_seqs: int = 8, num_blocks: int = 256, block_size: int = 16, *,
                 enable_prefix_caching: bool = False, preemption_mode: str = "recompute",
                 num_cpu_blocks: int | None = None, watermark: float = 0.01,
                 max_num_batched_tokens: int | None = None, queue_policy: str | QueuePolicy = "fcfs",
                 num_lookahead_tokens: int = 0):
        super().__init__(queue_policy)
        check_int(max_num_seqs, "max_num_seqs", 1)
        check_choice(preemption_mode, "preemption_mode", PREEMPTION_MODES)
        if max_num_batched_tokens is not None:
            check_int(max_num_batched_tokens, "max_num_batched_tokens", 1)
        if num_cpu_blocks is None:
            num_cpu_blocks = num_blocks if preemption_mode == "swap" else 0
        self.max_num_seqs = max_num_seqs
        self.preemption_mode = preemption_mode
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                          watermark=watermark, num_cpu_blocks=num_cpu_blocks)
        self.num_lookahead_tokens = num_lookahead_tokens
        self.num_preemptions = 0
        if enable_prefix_caching:
            self.name = f"{self.name}_prefix"

    @classmethod
    def from_config(cls, config, **kwargs) -> "PagedScheduler":
        """num_blocks = n_slots // block_size. kwargs: a subclass's own arguments."""
        block_size = config.block_size
        if config.n_slots < block_size:
            raise ValueError(f"n_slots must be >= block_size ({block_size}), got {config.n_slots}")
        return cls(max_num_seqs=config.max_num_seqs, num_blocks=config.n_slots // block_size, block_size=block_size,
                   enable_prefix_caching=config.enable_prefix_caching, preemption_mode=config.preemption_mode,
                   watermark=config.watermark,
                   queue_policy=cls.queue_policy_from(config),
                   num_lookahead_tokens=config.num_lookahead_tokens, **kwargs)

    def check_request(self, request: Request) -> None:
        bm = self.block_manager
        usable = bm.num_blocks - bm.watermark_blocks
        if bm.num_blocks_for(request.max_num_tokens) > usable:
            raise ValueError(f"request {request.request_id!r} needs {bm.num_blocks_for(request.max_num_tokens)} "
                             f"KV blocks (prompt + max_new_tokens = {request.max_num_tokens} tokens, block_size "
                             f"{bm.block_size}); only {usable} blocks are usable (num_blocks {bm.num_blocks} minus "
                             f"the watermark)")
        budget = self.max_num_batched_tokens
        if not self.chunked_prefill and budget is not None and request.max_num_tokens > budget:
            raise ValueError(f"request {request.request_id!r}: prompt + max_new_tokens = {request.max_num_tokens} "
                             f"tokens must be <= max_num_batched_tokens ({budget}) without chunked prefill "
                             f"(a recompute prefills them all in one step)")

    def token_budget(self) -> float:
        """This step's token budget (inf = no limit); the adaptive chunker overrides it."""
        return math.inf if self.max_num_batched_tokens is None else self.max_num_batched_tokens

    def schedule(self, now_s: float) -> SchedulerOutput:
        out = self.begin_step()
        self.schedule_running(out)
        if not out.preempted:
            self.schedule_swapped(out)
        if not out.preempted and not self.swapped:
            self.schedule_waiting(out)
        return self.finish_output(out)

    def begin_step(self) -> SchedulerOutput:
        """A new, empty plan; fixes this step's token budget (``token_budget``). A subclass that
        reorders the stages calls it first, then the stages it wants, then ``finish_output``."""
        return SchedulerOutput(token_budget=self.token_budget())

    def budget_left(self, out: SchedulerOutput) -> float:
        return out.token_budget - out.num_scheduled_tokens

    def num_new_tokens(self, req: Request, budget: float) -> int:
        """Tokens ``req`` computes this step given ``budget`` tokens left: all it has left, or,
        when that does not fit, a chunk of ``budget`` (chunked prefill) or 0 (wait)."""
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining == 1 and budget >= 1 and req.spec_token_ids:  # a decode verifying its drafts
            return 1 + len(self.drafts_that_fit(req, budget))
        if remaining <= budget:
            return remaining
        return int(budget) if self.chunked_prefill else 0

    @staticmethod
    def drafts_that_fit(req: Request, budget: float) -> list[int]:
        """The request's stored drafts, cut so the step (1 + drafts) fits the budget and emits at
        most the tokens the request may still produce."""
        k = min(len(req.spec_token_ids), int(min(budget, 1 << 30)) - 1, req.max_new_tokens - req.num_output_tokens - 1)
        return req.spec_token_ids[:max(0, k)]

    def with_lookahead(self, req: Request, n: int) -> int:
        """Slots ``req`` needs for ``n`` new tokens: n, plus the lookahead slots when the step samples."""
        if not self.num_lookahead_tokens or req.num_computed_tokens + n < req.num_tokens:
            return n
        return n + max(0, min(self.num_lookahead_tokens, req.max_num_tokens - req.num_computed_tokens - n))

    def allocate(self, req: Request, n: int, hits=None, use_watermark: bool = False):
        """Blocks for ``n`` new tokens and the lookahead slots; returns the copy-on-write copies, or
        None if they do not fit (see ``BlockManager.allocate_slots``)."""
        return self.block_manager.allocate_slots(req, self.with_lookahead(req, n), hits or (),
                                                 use_watermark=use_watermark)

    def service_order(self, running: list[Request]) -> list[Request]:
        """The order running requests get tokens and blocks (default: queue-policy order)."""
        return running

    def schedule_running(self, out: SchedulerOutput) -> None:
        """Stage 1: running requests get their new tokens' blocks, preempting the lowest-ranked."""
        self.running.sort(key=self.sort_key)
        planned = {s.request_id for s in out.scheduled}  # admitted earlier in this step (a reordered schedule)
        for req in self.service_order(list(self.running)):
            if req.status != RequestStatus.RUNNING or req.request_id in planned:
                continue  # preempted this step to make room for a better-ranked request, or planned
            n = self.num_new_tokens(req, self.budget_left(out))
            if n == 0:
                continue  # the budget is spent: it waits a step (keeps its blocks)
            while (copies := self.allocate(req, n)) is None:
                victim = self.victim(out)
                self.preempt(victim, out)
                if victim is req:
                    break
            else:
                out.blocks_to_copy += copies
                self._add(out, req, n)

    def schedule_swapped(self, out: SchedulerOutput) -> None:
        """Stage 2: swapped-out requests come back while their blocks fit."""
        bm = self.block_manager
        self.swapped.sort(key=self.sort_key)
        while self.swapped and len(self.running) < self.max_num_seqs:
            req = self.swapped[0]
            n = self.num_new_tokens(req, self.budget_left(out))
            if n == 0 or not bm.can_swap_in(req, num_new_tokens=self.with_lookahead(req, n)):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in += bm.swap_in(req.request_id)
            out.blocks_to_copy += self.allocate(req, n)
            self._run(req)
            self._add(out, req, n)

    def schedule_waiting(self, out: SchedulerOutput) -> None:
        """Stage 3: admit waiting requests in queue-policy order, no skipping ahead."""
        self.waiting.sort(key=self.sort_key)
        admitted = 0
        while self.waiting and len(self.running) < self.max_num_seqs and admitted != self.max_num_prefills:
            req = self.waiting[0]
            plan = self._admit(req, self.budget_left(out))
            if plan is None:
                break
            copies, n = plan
            self.waiting.pop(0)
            out.blocks_to_copy += copies
            self._run(req)
            self._add(out, req, n)
            admitted += 1

    def finish_output(self, out: SchedulerOutput) -> SchedulerOutput:
        bm = self.block_manager
        out.num_idle_rows = self.max_num_seqs - len(out.scheduled)
        out.block_tables = {s.request_id: bm.block_tables[s.request_id] for s in out.scheduled}
        return out

    def _add(self, out: SchedulerOutput, req: Request, n: int) -> None:
        drafts = req.spec_token_ids[:n - 1] if req.num_tokens - req.num_computed_tokens == 1 else []
        out.scheduled.append(ScheduledRequest(
            request=req, num_new_tokens=n, phase="prefill" if (n > 1 and not drafts) or req.is_prefill else "decode",
            row=self.rows[req.request_id], spec_token_ids=drafts))

    def victim(self, out: SchedulerOutput) -> Request:
        """The lowest-ranked running request not yet given tokens this step."""
        scheduled = {s.request_id for s in out.scheduled}
        return max((r for r in self.running if r.request_id not in scheduled), key=self.sort_key)

    def _admit(self, req: Request, budget: float) -> tuple[list[tuple[int, int]], int] | None:
        """Give a waiting request its blocks (fork, prefix-cache hits, new blocks) for this step's
        tokens; returns (copy-on-write copies, num_new_tokens), or None if they do not fit in
        the budget or the free blocks (nothing changed then)."""
        bm = self.block_manager
        parent = self._running_parent(req)
        if parent is not None:  # parallel sampling: share the parent's prompt blocks
            if parent.num_computed_tokens < parent.num_prompt_tokens or budget < 1:
                return None  # the parent's prompt is not computed yet: wait one step (FCFS)
            bm.fork(parent.request_id, req.request_id, req.num_prompt_tokens)
            req.num_computed_tokens = req.num_prompt_tokens - 1  # sample its own first token
            copies = self.allocate(req, 1, use_watermark=True)
            if copies is None:
                bm.free(req.request_id)
                req.num_computed_tokens = 0
                return None
            return copies, 1
        hits = bm.get_computed_blocks(req)
        # KV computed elsewhere (a prefill replica's, transferred): blocks for it, no compute
        external = max(0, req.num_external_computed_tokens - len(hits) * bm.block_size)
        req.num_computed_tokens = len(hits) * bm.block_size + external
        n = self.num_new_tokens(req, budget)
        req.num_computed_tokens -= external
        copies = self.allocate(req, external + n, hits, use_watermark=True) if n else None
        req.num_computed_tokens = 0 if copies is None else req.num_computed_tokens + external
        if copies is None:
            return None
        bm.record_prefix_hits(req, hits)
        return copies, n

    def _running_parent(self, req: Request) -> Request | None:
        return next((r for r in self.running if req.parent_request_id is not None and r.request_id ==
                     req.parent_request_id and r.prompt_token_ids == req.prompt_token_ids), None)

    def _run(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.take_row(req.request_id)

    def preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Take ``req`` off the running list: swap its KV out, or free it for recompute."""
        bm = self.block_manager
        self.running.remove(req)
        del self.rows[req.request_id]
        req.spec_token_ids = []  # drafts are proposed again after it resumes
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
        if self.preemption_mode == "swap" and bm.can_swap_out(req.request_id):
            out.blocks_to_swap_out += bm.swap_out(req.request_id)
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
        else:
            bm.free(req.request_id)
            req.num_computed_tokens = req.num_external_computed_tokens = 0  # transferred KV is lost too
            req.status = RequestStatus.PREEMPTED
            self.waiting.append(req)  # re-sorted at admission: ahead of every lower-ranked request

    def update(self, plan: SchedulerOutput, result: StepResult) -> list[Request]:
        finished = self.advance(plan, result)
        for s in plan.scheduled:
            if (s.spec_token_ids or self.num_lookahead_tokens) and not s.request.is_finished:
                # roll back the blocks of rejected drafts and of lookahead slots
                self.block_manager.trim(s.request_id, s.request.num_computed_tokens)
            self.block_manager.cache_full_blocks(s.request)
        for r in finished:
            self.running.remove(r)
            self.block_manager.free(r.request_id)
            del self.rows[r.request_id]
        return finished

    @property
    def num_kv_slots_used(self) -> int:
        """Physical KV slots holding computed tokens (a block shared by several requests counts once)."""
        return self.block_manager.num_slots_used(self.running)

    @property
    def num_kv_slots_reserved(self) -> int:
        """Slots of every block in use: the last block's empty slots are internal fragmentation."""
        return self.block_manager.num_used_blocks * self.block_manager.block_size
