"""Schedulers (pure Python): decide which requests run each step and how many new tokens each."""

from minibatch.scheduler.base import ScheduledRequest, Scheduler, SchedulerOutput, StepResult
from minibatch.scheduler.chunked import AdaptiveChunker, ChunkedPrefillScheduler, PrefillFirstScheduler
from minibatch.scheduler.orca import OrcaScheduler
from minibatch.scheduler.paged import PagedScheduler
from minibatch.scheduler.queue_policy import FCFS, SJF, Priority, QueuePolicy, make_queue_policy
from minibatch.scheduler.static import StaticScheduler

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput", "StepResult",
           "OrcaScheduler", "PagedScheduler", "StaticScheduler",
           "PrefillFirstScheduler", "ChunkedPrefillScheduler", "AdaptiveChunker",
           "QueuePolicy", "FCFS", "SJF", "Priority", "make_queue_policy"]
