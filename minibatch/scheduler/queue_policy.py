"""Queue policies: in which order a scheduler serves its waiting (and running) requests.

Every iteration-level scheduler (orca, paged, prefill_first, chunked) takes one. The scheduler
sorts by ``policy.key(request)`` (smallest first), breaking ties by arrival order, and uses the
same order to pick preemption victims (the largest key goes first).

* :class:`FCFS`: first come, first served (Orca Algorithm 1; vLLM's default).
* :class:`SJF`: shortest job first, job = prompt + max_new_tokens tokens. Minimizes mean
  latency when lengths are known (e.g. from a length predictor), but a long request can wait
  forever behind a stream of short ones.
* :class:`Priority`: lower ``Request.priority`` first (vLLM's ``--scheduling-policy priority``),
  with *aging*: every ``aging_s`` seconds a request has waited counts as one priority level.
  All requests age at the same rate, so the order at time t, by
  ``priority - (t - arrival_time_s) / aging_s``, is the order by
  ``priority + arrival_time_s / aging_s`` at every t: the key needs no clock. A request of
  priority p is overtaken only by requests that arrived less than ``(p - q) * aging_s`` seconds
  after it (q: their priority), a finite set, so it cannot starve. With ``aging_s=None`` a low
  priority request waits as long as higher priority ones keep coming.

A queue policy of one's own is a QueuePolicy subclass with a ``name`` and ``key``, added with
:func:`register_queue_policy` (in a ``--policy-module`` file: ``--queue-policy NAME`` then selects it).

Source: the classic FCFS / SJF / priority schedulers; aging is the classic remedy for
starvation in priority scheduling (e.g. Silberschatz, Operating System Concepts, §5.3).
"""

from __future__ import annotations

from minibatch.request import Request


class QueuePolicy:
    """Base class: ``key(request)`` is a sort key, smaller = served first.

    static: True when ``key(request)`` depends only on what a request has when it arrives (its
    arrival time, prompt length, max_new_tokens, priority): the scheduler then computes each key
    once, when the request is added, instead of at every step's sort. Leave it False for a key
    that changes while the request is served (e.g. its output tokens so far).
    """

    name = "base"
    static = False
    takes_aging = False  # made with aging_s (--aging-s), as Priority is

    def key(self, request: Request) -> tuple:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


QUEUE_POLICIES: dict[str, type[QueuePolicy]] = {}  # name -> class, like the policy table POLICIES


def register_queue_policy(cls: type[QueuePolicy]) -> type[QueuePolicy]:
    """Add a QueuePolicy subclass under ``cls.name`` (usable as a class decorator); returns it. It is made with no
    arguments (with ``aging_s`` when ``takes_aging``).

    Raises:
        ValueError: not a QueuePolicy subclass, no lowercase name, or the name is another class's already."""
    if not (isinstance(cls, type) and issubclass(cls, QueuePolicy)) or not cls.name.isidentifier() \
            or cls.name != cls.name.lower() or cls.name == "base":
        raise ValueError(f"a queue policy is a QueuePolicy subclass with a lowercase name, got {cls!r}")
    held = QUEUE_POLICIES.get(cls.name)
    if held is not None and (held.__qualname__, held.__module__) != (cls.__qualname__, cls.__module__):
        raise ValueError(f"queue policy {cls.name!r} is registered already")  # (the same class run again may)
    QUEUE_POLICIES[cls.name] = cls
    return cls


def queue_policy_names() -> tuple[str, ...]:
    """The registered queue policies' names, built-ins first."""
    return tuple(QUEUE_POLICIES)


@register_queue_policy
class FCFS(QueuePolicy):
    """First come, first served: by arrival_time_s (ties: the order requests were added)."""

    name = "fcfs"
    static = True

    def key(self, request: Request) -> tuple:
        return (request.arrival_time_s,)


@register_queue_policy
class SJF(QueuePolicy):
    """Shortest job first: by prompt + max_new_tokens tokens (ties: arrival)."""

    name = "sjf"
    static = True

    def key(self, request: Request) -> tuple:
        return (request.max_num_tokens, request.arrival_time_s)


@register_queue_policy
class Priority(QueuePolicy):
    """Lower ``Request.priority`` first; ``aging_s`` seconds of waiting = one level (None: no aging).

    Raises:
        ValueError: aging_s not > 0 (or None).
    """

    name = "priority"
    static = True
    takes_aging = True

    def __init__(self, aging_s: float | None = 1.0):
        if aging_s is not None and not aging_s > 0:
            raise ValueError(f"aging_s must be > 0 seconds or None (no aging), got {aging_s}")
        self.aging_s = aging_s

    def key(self, request: Request) -> tuple:
        aged = request.arrival_time_s / self.aging_s if self.aging_s else 0.0
        return (request.priority + aged, request.arrival_time_s)

    def __repr__(self) -> str:
        return f"Priority(aging_s={self.aging_s})"


def make_queue_policy(name: str | QueuePolicy = "fcfs", aging_s: float | None = 1.0) -> QueuePolicy:
    """A policy by registered name ("fcfs", "sjf", "priority", or one of :func:`register_queue_policy`; aging_s is
    for those that take it, "priority"), or ``name`` itself if it is already a QueuePolicy.

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(name, QueuePolicy):
        return name
    if name not in QUEUE_POLICIES:
        raise ValueError(f"queue policy must be one of {', '.join(QUEUE_POLICIES)}, got {name!r}")
    cls = QUEUE_POLICIES[name]
    return cls(aging_s) if cls.takes_aging else cls()
