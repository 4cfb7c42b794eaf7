"""Many replicas behind a router, on one simulated timeline.

Each replica is a whole :class:`~minibatch.engine.Engine`: its own scheduler, KV cache and clock (a
:class:`~minibatch.clock.SimClock` on the calibrated profile), exactly as ``simulate`` runs one. The driver is a
discrete-event loop over them: it always advances the replica whose clock is furthest behind by one step, and
hands a request to the router once every busy replica's clock has reached the request's arrival, so the router
sees each replica as it is at that moment (step granularity: a step in progress counts as done). A request's
finish releases the next turn of its conversation (multi-turn workloads, ``minibatch.cluster.multiturn``) and,
under an admission limit, a request the router was holding. With one replica and no limit this is exactly
``simulate``'s run (``tests/test_cluster.py``).

Disaggregated prefill/decode (DistServe, Zhong et al., OSDI'24; Splitwise, Patel et al., ISCA'24): replicas have a
role; a request is first routed among the "prefill" replicas with max_new_tokens 1 (prefill and the first token),
its KV is then transferred (``KVLink``: prompt tokens x KV bytes per token / bandwidth + latency) and it continues
on a "decode" replica, which receives the KV as already computed (vLLM's KV connector: external computed tokens)
and generates the rest. The user-facing request gets the first token's time from the prefill replica and the
others from the decode replica. The transfer is priced for the whole prompt before the decode replica is chosen: a
prefix that replica has cached is reused there (not computed, not allocated twice) but still paid for on the link,
an upper bound (vLLM's connectors pull only what the decode side lacks).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from minibatch.checks import MAX_SECONDS, FieldTypeError, check_int, check_real, short_repr
from minibatch.cluster.routers import Replica, Router
from minibatch.request import Request, RequestStatus

RELEASE = "release"  # an event's kind: a finished request frees its replica's slot (not a role to route to)


@dataclass(frozen=True)
class KVLink:
    """The cost of moving a request's KV cache between replicas: latency_s + bytes / bytes_per_s. Defaults: a
    datacenter NIC's 25 GB/s and 10 us; a PCIe 4.0 x16 link is about 25 GB/s too, NVLink hundreds."""

    bytes_per_s: float = 25e9
    latency_s: float = 10e-6

    def __post_init__(self):
        check_real(self.bytes_per_s, "KVLink.bytes_per_s", 0.0, 1e15, low_open=True)
        check_real(self.latency_s, "KVLink.latency_s (seconds)", 0.0, MAX_SECONDS)

    def transfer_s(self, num_tokens: int, kv_bytes_per_token: int) -> float:
        return self.latency_s + num_tokens * kv_bytes_per_token / self.bytes_per_s


@dataclass
class ClusterRun:
    """What a cluster run leaves: the replicas (engines and their traces), every request the users see (a
    disaggregated request once, merged from its prefill and decode parts), the conversations, the router."""

    replicas: list[Replica]
    requests: list[Request]
    router: Router
    conversations: list = field(default_factory=list)
    num_transfers: int = 0
    transfer_time_s: float = 0.0


class Cluster:
    """Replicas (``engines``, each with its own SimClock) behind ``router``.

    Args:
        roles: per engine "both" (default: colocated), or "prefill" / "decode" (disaggregated: at least one of
            each, and no "both").
        max_outstanding: the router's admission limit: a replica with this many unfinished requests takes no
            more; a request no replica may take waits at the router (its TTFT counts the wait). None: no limit.
        kv_link: the KV transfer cost between a prefill and a decode replica.
        kv_bytes_per_token: the model's KV bytes per token in the cache dtype (for the transfer).
        max_model_len: a multi-turn conversation ends before a turn that would not fit.

    Raises:
        ValueError: no engines, roles that do not pair up, a bad max_outstanding or kv_bytes_per_token.
        FieldTypeError: a router without ``route`` (e.g. its name: use ``get_router(name)``).
    """

    def __init__(self, engines: list, router: Router, *, roles: list[str] | None = None,
                 max_outstanding: int | None = None, kv_link: KVLink = KVLink(), kv_bytes_per_token: int = 0,
                 max_model_len: int | None = None):
        roles = list(roles or ["both"] * len(engines))
        if not engines or len(roles) != len(engines) or not set(roles) <= {"both", "prefill", "decode"}:
            raise ValueError("a cluster needs one or more engines, each with a role in both, prefill, decode")
        if "both" in roles and len(set(roles)) > 1 or (set(roles) & {"prefill", "decode"}
                                                        and set(roles) != {"prefill", "decode"}):
            raise ValueError("roles: all 'both' (colocated), or 'prefill' and 'decode' replicas (disaggregated)")
        if isinstance(router, type) or not callable(getattr(router, "route", None)):
            raise FieldTypeError(f"router must be a Router instance (get_router(name)), got {short_repr(router)}")
        if max_outstanding is not None:
            check_int(max_outstanding, "max_outstanding (None: no admission limit)", 1, 1 << 20)
        check_int(kv_bytes_per_token, "kv_bytes_per_token", 0, 1 << 30)
        if any(role == "decode" and not getattr(e.scheduler, "receives_external_kv", False)
               for e, role in zip(engines, roles)):  # a decode replica receives each prompt's KV
            raise ValueError("a decode replica needs a paged scheduler (one that receives KV from elsewhere)")
        needs = getattr(router, "needs", None)
        if needs == "prefix_cache" and any(e.scheduler.prefix_cache_counts() is None for e in engines) or \
                needs == "kv_cache" and any(e.scheduler.kv_geometry() is None for e in engines):
            kind = "prefix caches (a *_prefix policy)" if needs == "prefix_cache" else "KV caches (a paged policy)"
            raise ValueError(f"router {router.name} reads the replicas' {kind}, which this policy does not have: "
                             "choose another router or policy")
        self.replicas = [Replica(i, e, role) for i, (e, role) in enumerate(zip(engines, roles))]
        self.router, self.max_outstanding, self.kv_link = router, max_outstanding, kv_link
        self.kv_bytes_per_token, self.max_model_len = kv_bytes_per_token, max_model_len
        self.disaggregated = "prefill" in roles

    # ------------------------------------------------------------------ the loop
    def run(self, requests: list[Request] = (), conversations: list = ()) -> ClusterRun:
        """Run fresh copies of ``requests`` (and the turns of ``conversations``) to completion, once per Cluster.

        Raises:
            ValueError: the engines have run before, two requests share a request_id, or a request cannot run on
                a replica it may be routed to (too long for its KV cache or context; before any step).
        """
        requests = list(requests)  # (a generator would be spent by the checks)
        self._check(requests)
        self._events: list = []  # heap of (time, not a release, order, role or RELEASE, request or replica, new)
        self._order = 0
        self._held: deque = deque()  # requests waiting at the router (admission limit)
        self._conversation_of: dict[str, object] = {}
        self._parts: dict[str, Request] = {}  # decode part's id -> the user's request (disaggregated)
        self._result = ClusterRun(self.replicas, [], self.router, list(conversations))
        for r in requests:
            self._arrive(r.copy())
        for c in conversations:
            first = c.next_request(c.start_time_s, self.max_model_len)
            if first is not None:
                self._conversation_of[first.request_id] = c
                self._arrive(first)
        while True:
            busy = [r for r in self.replicas if r.engine.has_unfinished()]
            t_min = min((r.engine.clock.now_s for r in busy), default=math.inf)
            if self._events and self._events[0][0] <= t_min:
                t, _, _, role, request, new = heapq.heappop(self._events)
                if role == RELEASE:  # a replica's request finished at t: its slot is free from t on
                    self._release(request, t)
                    continue
                if new:  # a user's request (not a held one, nor a decode part)
                    self._result.requests.append(request)
                self._dispatch(request, t, role)
                continue
            if not busy:
                break
            replica = min(busy, key=lambda r: (r.engine.clock.now_s, r.index))
            record = replica.engine.step()
            for rid in record.finished if record is not None else ():
                self._finished(replica, replica.engine.requests[rid], record.end_s)
        if self._held:
            raise RuntimeError(f"{len(self._held)} requests still held at the router with every replica idle")
        return self._result

    def _check(self, requests) -> None:
        if any(r.engine.requests or r.engine.trace for r in self.replicas):
            raise ValueError("a Cluster runs once: its engines have run requests already (make new engines)")
        if not all(isinstance(r, Request) for r in requests):
            raise FieldTypeError(f"requests must be Requests, got {short_repr(list(requests))}")
        ids = [r.request_id for r in requests]
        if len(set(ids)) < len(ids):
            raise ValueError(f"request_id {next(i for i in ids if ids.count(i) > 1)!r} is given twice")
        for r in requests:  # each on every replica the router may pick (a disaggregated one's parts on their roles)
            fresh = r.copy()  # what run() adds (r itself may have run before); check_request only reads it
            part = fresh.copy() if self.disaggregated else fresh
            part.max_new_tokens = 1 if self.disaggregated else part.max_new_tokens  # the prefill part, as _dispatch
            for replica in self.replicas:
                replica.engine.check_request(part if replica.role == "prefill" else fresh)

    def _push(self, t: float, role: str, request: Request, new: bool = False) -> None:
        """An event: at time ``t``, route ``request`` among the replicas of ``role`` (or free a slot of the replica
        given as ``request`` when ``role`` is RELEASE: at one time, slots free before anything is routed)."""
        heapq.heappush(self._events, (t, role != RELEASE, self._order, role, request, new))
        self._order += 1

    def _arrive(self, request: Request) -> None:
        self._push(request.arrival_time_s, "prefill" if self.disaggregated else "both", request, new=True)

    def _dispatch(self, request: Request, t: float, role: str) -> None:
        """Route ``request`` at time ``t`` among the replicas of ``role`` under the admission limit, or hold it."""
        eligible = [r for r in self.replicas if r.role == role
                    and (self.max_outstanding is None or r.outstanding < self.max_outstanding)]
        if not eligible:
            self._held.append((request, role))
            return
        replica = self.router.route(request, eligible, t)
        if not any(replica is r for r in eligible):  # (an index, None, another cluster's replica)
            raise ValueError(f"{type(self.router).__name__}.route must return one of the replicas it is given, "
                             f"got {short_repr(replica)}")
        if role == "prefill":  # the prefill part: prompt and first token only
            part = request.copy()
            part.max_new_tokens = 1
            self._parts[request.request_id] = request
            request = part
        engine = replica.engine
        if not engine.has_unfinished() and engine.clock.now_s < t:
            engine.clock.advance_to(t)  # idle until now: a held or transferred request cannot start earlier
        try:
            engine.add_request(request)
        except ValueError as e:  # run() checked every request it was given: this is a later turn of a conversation
            raise ValueError(f"{e}: a conversation's turn grew past what a replica holds; give the replicas more KV "
                             "(--n-slots) or a lower --max-model-len (a conversation ends before a longer turn)"
                             ) from None
        replica.outstanding += 1
        replica.routed += 1

    def _finished(self, replica: Replica, request: Request, end_s: float) -> None:
        self._push(end_s, RELEASE, replica)  # its slot, when every replica has reached end_s (not earlier arrivals)
        if replica.role == "prefill":
            self._to_decode(request, end_s)
            return
        user = self._parts.pop(request.request_id, None)
        if user is not None:  # the decode part of a disaggregated request: merge into the user's request
            merge_decode_part(user, request)
            request = user
        conversation = self._conversation_of.pop(request.request_id, None)
        if conversation is not None:
            nxt = conversation.next_request(end_s, self.max_model_len)
            if nxt is not None:
                self._conversation_of[nxt.request_id] = conversation
                self._arrive(nxt)

    def _release(self, replica: Replica, t: float) -> None:
        """One of ``replica``'s requests finished at ``t``: the oldest request held for its role (first come, first
        served) is routed now, before any later arrival can take the slot."""
        replica.outstanding -= 1
        oldest = next((i for i, (_, role) in enumerate(self._held) if role == replica.role), None)
        if oldest is not None:
            held, role = self._held[oldest]
            del self._held[oldest]
            self._dispatch(held, t, role)

    def _to_decode(self, part: Request, end_s: float) -> None:
        """A prefill part finished: its KV travels to a decode replica, where the rest of the output is made."""
        user = self._parts[part.request_id]
        user.first_scheduled_time_s = part.first_scheduled_time_s
        user.output_token_ids, user.token_times_s = list(part.output_token_ids), list(part.token_times_s)
        if user.max_new_tokens == 1:  # nothing left to decode
            self._parts.pop(part.request_id)
            finish_user(user, part)
            return
        transfer_s = self.kv_link.transfer_s(part.num_prompt_tokens, self.kv_bytes_per_token)
        self._result.num_transfers += 1
        self._result.transfer_time_s += transfer_s
        rest = Request(part.request_id, part.all_token_ids, user.max_new_tokens - 1, user.sampling,
                       arrival_time_s=end_s + transfer_s, priority=user.priority,
                       num_external_computed_tokens=part.num_prompt_tokens)
        self._push(rest.arrival_time_s, "decode", rest)


def merge_decode_part(user: Request, part: Request) -> None:
    """The user's request gets the decode part's tokens, times and finish (its first token came from prefill)."""
    user.output_token_ids += part.output_token_ids
    user.token_times_s += part.token_times_s
    finish_user(user, part)
    user.num_preemptions += part.num_preemptions


def finish_user(user: Request, last: Request) -> None:
    user.status, user.finish_reason, user.finish_time_s = RequestStatus.FINISHED, last.finish_reason, last.finish_time_s
