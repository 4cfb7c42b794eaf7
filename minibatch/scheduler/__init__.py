"""Schedulers (pure Python): decide which requests run each step and how many new tokens each.

Static batching (``static.py``), Orca (``orca.py``), the paged scheduler (``paged.py``) and
chunked prefill (``chunked.py``) differ only in ``schedule()`` and ``update()``; the order of
service is a queue policy (``queue_policy.py``); the plan they hand the executor and the result
they get back are in ``output.py``.

Paged scheduling (vLLM, Kwon et al. SOSP'23, §4.2-§4.5; the vLLM v0 scheduler).
Orca reserves prompt + max_new_tokens slots per request at admission; here a request gets blocks
only as it needs them, so admission asks "are there free blocks for this prompt?" and many more
requests fit in the same memory. The price: a running request may find no free block for its
next token. Then the scheduler *preempts* (§4.5) the lowest-ranked running request (the latest
arrival under FCFS), either by

* ``recompute``: free its blocks and put it back in the waiting queue; when it is admitted
  again it prefills its prompt *and* the tokens it already generated, in one step; or
* ``swap``: copy its blocks to CPU memory, and copy them back when blocks free up.

One step (vLLM's unifying idea: each request computes ``num_new_tokens`` more tokens, a whole
prompt, one decode token or, with chunking, a slice of the prompt):

    1. running requests, in queue-policy order: make room for each one's new tokens,
       preempting from the lowest-ranked end while there is none;
    2. if nothing was preempted: swapped-out requests come back (best-ranked first);
    3. if nothing was preempted and nobody is swapped out: admit waiting requests in order,
       no skipping ahead, while their prompt fits above the watermark (prefix-cache hits need
       no new blocks; a parallel sample forks its parent's prompt blocks).

With a token budget (``max_num_batched_tokens``) a step schedules at most that many tokens; a
request that does not fit whole waits for a later step, unless the scheduler chunks prefills
(:mod:`minibatch.scheduler.chunked`). Subclasses change only the order of these stages.

No request is lost or duplicated: a request is always in exactly one of waiting, running or
swapped until it finishes.
"""

from minibatch.scheduler.base import Scheduler, SchedulerOutput, StepResult
from minibatch.scheduler.output import ScheduledRequest
from minibatch.scheduler.chunked import AdaptiveChunker, ChunkedPrefillScheduler, PrefillFirstScheduler
from minibatch.scheduler.orca import OrcaScheduler
from minibatch.scheduler.paged import PagedScheduler
from minibatch.scheduler.queue_policy import (FCFS, SJF, Priority, QueuePolicy, make_queue_policy,
                                             register_queue_policy)
from minibatch.scheduler.static import StaticScheduler

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput", "StepResult",
           "OrcaScheduler", "PagedScheduler", "StaticScheduler",
           "PrefillFirstScheduler", "ChunkedPrefillScheduler", "AdaptiveChunker",
           "QueuePolicy", "FCFS", "SJF", "Priority", "make_queue_policy", "register_queue_policy"]
