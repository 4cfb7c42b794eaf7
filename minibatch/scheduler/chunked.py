"""Chunked prefill (Sarathi-Serve) and its baseline, prefill-first scheduling.

Sarathi-Serve (Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI'24): a step's time grows with the tokens it computes, so a step that
prefills a 2000-token prompt makes every running decode wait for it: a *generation stall*
(§3.2, Figure 7). Two ways to schedule that prompt:

* **prefill-first** (vLLM v0, nano-vllm; Sarathi §2.5 "prefill-prioritizing"): whenever a
  waiting request can be admitted, the step prefills new prompts only and every decode waits;
  otherwise the step decodes every running request. Throughput is good (big prefill batches),
  ITL is not: each admission stalls all decodes for a whole prefill.
* **stall-free batching with chunked prefill** (Sarathi §4.1-§4.3): each step has a token
  budget (``max_num_batched_tokens``). Running decodes go first (1 token each), then the
  partial prefills that are already running, then new requests; a prefill that does not fit
  the budget left is cut to it and continues next step. Prefill chunks and decodes run in the
  same packed forward, so a decode never waits for more than one budget's worth of prefill.

A chunk of request r computes tokens num_computed_tokens .. num_computed_tokens + n - 1; its
queries attend to all earlier tokens, read from the paged KV cache (the same path prefix-cache
hits take), so chunking needs no new runner code: ``num_new_tokens`` is simply smaller than what
is left. Only the chunk that reaches the last prompt token samples a token.

:class:`AdaptiveChunker` picks the budget per step from a fitted step-time model so that a step
stays under a target ITL (Sarathi §4.3 chooses one budget offline
from profiled step times and a TBT SLO; here the choice is made every step, online).
"""

from __future__ import annotations

import math
from collections import deque

import torch

from minibatch.request import Request
from minibatch.scheduler.base import SchedulerOutput
from minibatch.scheduler.config import ChunkedConfig, PrefillFirstConfig
from minibatch.scheduler.paged import PagedScheduler


class PrefillFirstScheduler(PagedScheduler):
    """A step is all prefill or all decode (vLLM v0's default scheduler, nano-vllm).

    If a waiting request can be admitted, the step prefills as many whole prompts as fit the
    free blocks, ``max_num_seqs`` and the token budget (``max_num_batched_tokens``, default no limit);
    running requests do not decode in that step. Otherwise every running request decodes
    (preempting when blocks run out, as :class:`PagedScheduler`).

    Args:
        max_num_prefills: most prompts prefilled in one step, >= 1, or None (no limit).
            1 = one prompt per step, the baseline for batching prefills together.
        Other arguments: as :class:`PagedScheduler`.

    Raises:
        ValueError: max_num_prefills < 1, or a bad PagedScheduler argument.
    """

    name = "prefill_first"
    config_cls = PrefillFirstConfig

    @classmethod
    def from_config(cls, config, **kwargs) -> "PrefillFirstScheduler":
        return super().from_config(config, max_num_prefills=config.max_num_prefills, **kwargs)

    def __init__(self, *args, max_num_prefills: int | None = None, **kwargs):
        if max_num_prefills is not None and max_num_prefills < 1:
            raise ValueError(f"max_num_prefills must be >= 1 or None, got {max_num_prefills}")
        super().__init__(*args, **kwargs)
        self.max_num_prefills = max_num_prefills

    def schedule(self, now_s: float) -> SchedulerOutput:
        out = self.begin_step()
        if not self.swapped:
            self.schedule_waiting(out)  # a prefill-only step if anything is admitted
        if not out.scheduled:
            self.schedule_running(out)  # else a decode-only step
            if not out.preempted:
                self.schedule_swapped(out)
        return self.finish_output(out)


class ChunkedPrefillScheduler(PagedScheduler):
    """Sarathi-Serve stall-free batching: decodes first, then prefill chunks, under a token budget.

    Args:
        max_num_batched_tokens: the token budget per step, >= 1 (default 512, as vLLM v0 used
            with chunked prefill). Ignored when ``chunker`` is given.
        chunker: an :class:`AdaptiveChunker` that picks each step's budget from step times.
        Other arguments: as :class:`PagedScheduler` (prefix caching, preemption, queue policy).

    Each step: running decodes (1 token each, in queue-policy order), then running partial
    prefills, then swapped and waiting requests; each prefill gets min(tokens left, budget left).
    The budget is a cap, not a target: if fewer tokens are ready the step is smaller.

    Raises:
        ValueError: max_num_batched_tokens < 1, or a bad PagedScheduler argument.
    """

    name = "chunked"
    chunked_prefill = True
    config_cls = ChunkedConfig

    @classmethod
    def from_config(cls, config, **kwargs) -> "ChunkedPrefillScheduler":
        """target_itl_s: an AdaptiveChunker picks each step's budget."""
        chunker = None if config.target_itl_s is None else AdaptiveChunker(config.target_itl_s)
        return super().from_config(config, max_num_batched_tokens=config.max_num_batched_tokens, chunker=chunker,
                                   **kwargs)

    def __init__(self, max_num_seqs: int = 8, num_blocks: int = 256, block_size: int = 16, *,
                 max_num_batched_tokens: int = 512, chunker: "AdaptiveChunker | None" = None, **kwargs):
        if max_num_batched_tokens is None or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        super().__init__(max_num_seqs, num_blocks, block_size, max_num_batched_tokens=max_num_batched_tokens, **kwargs)
        self.chunker = chunker

    def token_budget(self) -> float:
        if self.chunker is None:
            return self.max_num_batched_tokens
        num_decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        return self.chunker.token_budget(num_decodes)

    def service_order(self, running: list[Request]) -> list[Request]:
        # stable sort: decodes (one token left) first, then partial prefills, each in policy order
        return sorted(running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)

    def observe_step(self, record) -> None:
        super().observe_step(record)
        if self.chunker is not None:
            self.chunker.observe(record)


# Rough smollm2-135m numbers on a 2-core CPU (the simulated clock's default CostModel): a step's fixed
# cost, a prefill token's, and a decode token's (one token plus one row).
DEFAULT_PRIOR = (0.030, 0.0015, 0.0015 + 0.0005)


class AdaptiveChunker:
    """Choose each step's token budget so the step takes about ``target_itl_s`` seconds.

    Step time is modeled as

        step_s = fixed_s + prefill_token_s * num_prefill_tokens + decode_token_s * num_decode_tokens

    fitted by least squares over the last ``window`` steps the engine reports (its measured or
    simulated durations); until ``min_samples`` steps with enough variety to fit all three
    coefficients have been seen (or if a fit gives a negative coefficient), the prior is used.
    Then, with d running decodes,

        chunk = (target_itl_s - fixed_s - decode_token_s * d) / prefill_token_s

    clamped to [min_chunk, max_chunk], and the budget is d + chunk tokens. min_chunk >= 1 keeps
    prefills moving even when the decodes alone already exceed the target.

    Args:
        target_itl_s: the step time (= ITL of the decodes in it) to aim for, seconds, > 0.
        prior: (fixed_s, prefill_token_s, decode_token_s), seconds; default ``DEFAULT_PRIOR``.
        min_chunk, max_chunk: bounds on the prefill tokens per step, 1 <= min_chunk <= max_chunk.
        window, min_samples: steps kept for the fit (>= 3), and needed before fitting (>= 3).

    Raises:
        ValueError: an argument out of range (the message names it).
    """

    def __init__(self, target_itl_s: float, prior: tuple[float, float, float] | None = None, *,
                 min_chunk: int = 16, max_chunk: int = 8192, window: int = 256, min_samples: int = 16):
        if not target_itl_s > 0:
            raise ValueError(f"target_itl_s must be > 0 seconds, got {target_itl_s}")
        if not 1 <= min_chunk <= max_chunk:
            raise ValueError(f"need 1 <= min_chunk <= max_chunk, got min_chunk={min_chunk}, max_chunk={max_chunk}")
        if window < 3 or not 3 <= min_samples <= window:
            raise ValueError(f"need window >= 3 and 3 <= min_samples <= window, "
                             f"got window={window}, min_samples={min_samples}")
        if prior is None:
            prior = DEFAULT_PRIOR
        if len(prior) != 3 or prior[1] <= 0 or min(prior) < 0:
            raise ValueError(f"prior must be (fixed_s >= 0, prefill_token_s > 0, decode_token_s >= 0), got {prior}")
        self.target_itl_s = target_itl_s
        self.min_chunk, self.max_chunk = min_chunk, max_chunk
        self.min_samples = min_samples
        self.coefficients = tuple(float(c) for c in prior)  # (fixed_s, prefill_token_s, decode_token_s)
        self.num_fits = 0
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=window)

    def observe(self, record) -> None:
        """Add one step (a StepRecord: prefill and decode tokens, duration) and refit."""
        self._samples.append((record.num_prefill_tokens, record.num_decode_tokens, record.duration_s))
        if len(self._samples) < self.min_samples:
            return
        x = torch.tensor([[1.0, p, d] for p, d, _ in self._samples], dtype=torch.float64)
        y = torch.tensor([t for _, _, t in self._samples], dtype=torch.float64)
        if torch.linalg.matrix_rank(x) < 3:
            return  # e.g. only decode steps so far: the prefill cost is not identifiable yet
        coef = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].tolist()
        if coef[0] >= 0 and coef[1] > 0 and coef[2] >= 0 and all(map(math.isfinite, coef)):
            self.coefficients = tuple(coef)
            self.num_fits += 1

    def token_budget(self, num_decodes: int) -> int:
        """The budget for a step with ``num_decodes`` running decodes: decodes + chunk tokens (each
        step's choice is in its plan and record, ``token_budget``)."""
        fixed_s, prefill_s, decode_s = self.coefficients
        room = (self.target_itl_s - fixed_s - decode_s * num_decodes) / prefill_s
        chunk = min(self.max_chunk, max(self.min_chunk, math.floor(room + 1e-9)))  # 1e-9: float round-off
        return num_decodes + chunk
