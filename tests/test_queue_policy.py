"""Queue policies (FCFS, SJF, priority with aging) in every iteration-level scheduler: the order
requests are admitted in, and starvation: under a stream of short requests that keeps the server
saturated, a low-priority (or long) request waits for the whole stream without aging, and with
aging is overtaken only by requests that arrived less than (its priority) x aging_s later."""

import pytest

from minibatch import Engine, Request, SamplingParams, SimClock, SimExecutor, make_engine
from minibatch.scheduler import (
    FCFS, SJF, ChunkedPrefillScheduler, OrcaScheduler, PagedScheduler, PrefillFirstScheduler, Priority,
    make_queue_policy,
)

GREEDY = SamplingParams(ignore_eos=True)
ITERATION_LEVEL = ["orca", "paged", "prefill_first", "chunked"]


def engine_for(policy, queue_policy, aging_s=1.0, max_num_seqs=1):
    return make_engine(policy, SimExecutor(), SimClock(), max_num_seqs=max_num_seqs, n_slots=4096,
                       queue_policy=queue_policy, aging_s=aging_s)


def admission_order(engine, reqs):
    engine.generate(reqs)
    return [r.request_id for r in sorted(reqs, key=lambda r: (r.first_scheduled_time_s, r.request_id))]


@pytest.mark.parametrize("policy", ITERATION_LEVEL)
def test_orders(policy):
    # all arrive at 0; with max_num_seqs=1 admission order is the queue order
    lens = {"a": (30, 9), "b": (5, 2), "c": (12, 4), "d": (5, 1)}
    prio = {"a": 1, "b": 2, "c": 0, "d": 1}

    def reqs():
        return [Request(k, [3] * p, n, GREEDY, priority=prio[k]) for k, (p, n) in lens.items()]

    assert admission_order(engine_for(policy, "fcfs"), reqs()) == ["a", "b", "c", "d"]
    assert admission_order(engine_for(policy, "sjf"), reqs()) == ["d", "b", "c", "a"]  # by prompt + max_new
    assert admission_order(engine_for(policy, "priority"), reqs()) == ["c", "a", "d", "b"]  # ties by arrival


def stream_with_one_low(low_priority=3, low_prompt=4, n_stream=150, gap_s=0.05):
    """Short priority-0 requests every gap_s (faster than one server slot can finish them), and
    one request "low" at 0.05 s: low priority, or (for SJF) a long prompt."""
    reqs = [Request(f"s{i:03d}", [4] * 4, 4, GREEDY, arrival_time_s=gap_s * i) for i in range(n_stream)]
    reqs.append(Request("low", [5] * low_prompt, 4, GREEDY, arrival_time_s=0.051, priority=low_priority))
    return sorted(reqs, key=lambda r: r.arrival_time_s)


@pytest.mark.parametrize("policy", ITERATION_LEVEL)
def test_priority_without_aging_starves(policy):
    reqs = stream_with_one_low()
    engine_for(policy, "priority", aging_s=None).generate(reqs)
    low = next(r for r in reqs if r.request_id == "low")
    assert low.first_scheduled_time_s == max(r.first_scheduled_time_s for r in reqs)  # served last
    assert low.first_scheduled_time_s > 10 * 0.05 * 150 / 10  # long after the stream's arrivals end (7.5 s)


@pytest.mark.parametrize("policy", ITERATION_LEVEL)
@pytest.mark.parametrize("aging_s", [0.25, 1.0])
def test_priority_with_aging_does_not_starve(policy, aging_s):
    reqs = stream_with_one_low(low_priority=3)
    engine_for(policy, "priority", aging_s=aging_s).generate(reqs)
    low = next(r for r in reqs if r.request_id == "low")
    assert low.is_finished
    overtook = [r for r in reqs if r.arrival_time_s > low.arrival_time_s
                and r.first_scheduled_time_s < low.first_scheduled_time_s]
    # only requests that arrived within priority x aging_s after "low" may be served before it ...
    assert overtook and all(r.arrival_time_s < low.arrival_time_s + low.priority * aging_s for r in overtook)
    # ... so it is served long before the stream ends
    assert low.first_scheduled_time_s < 0.5 * max(r.first_scheduled_time_s for r in reqs)


@pytest.mark.parametrize("policy", ITERATION_LEVEL)
def test_sjf_starves_a_long_request_fcfs_does_not(policy):
    reqs = stream_with_one_low(low_priority=0, low_prompt=40)
    engine_for(policy, "sjf").generate(reqs)
    long_req = next(r for r in reqs if r.request_id == "low")
    assert long_req.first_scheduled_time_s == max(r.first_scheduled_time_s for r in reqs)
    reqs = stream_with_one_low(low_priority=0, low_prompt=40)
    engine_for(policy, "fcfs").generate(reqs)
    order = [r.request_id for r in sorted(reqs, key=lambda r: r.first_scheduled_time_s)]
    assert order.index("low") == 2  # after s000 and s001, which arrived before it


def test_preemption_victim_follows_the_queue_policy():
    """Under memory pressure the paged scheduler preempts the lowest-ranked running request:
    with priority, the low-priority one, even though it arrived first."""
    reqs = [Request("low", [3] * 8, 40, GREEDY, arrival_time_s=0.0, priority=5),
            Request("high", [4] * 8, 40, GREEDY, arrival_time_s=0.01, priority=0)]
    engine = make_engine("paged", SimExecutor(), SimClock(), max_num_seqs=4, n_slots=64, block_size=4,
                         queue_policy="priority", aging_s=None, watermark=0.0)
    engine.generate(reqs)
    victims = [rid for rec in engine.trace for rid in rec.preempted]
    assert victims and set(victims) == {"low"}
    assert reqs[1].finish_time_s < reqs[0].finish_time_s


def test_keys_and_errors():
    a = Request("a", [1] * 10, 5, arrival_time_s=2.0, priority=1)
    b = Request("b", [1] * 3, 5, arrival_time_s=0.0, priority=3)
    assert FCFS().key(b) < FCFS().key(a)
    assert SJF().key(b) < SJF().key(a)  # 8 tokens < 15 tokens
    assert Priority(aging_s=None).key(a) < Priority(aging_s=None).key(b)
    # with aging 0.5 s per level, b waited 2 s longer = 4 levels: 3 + 0 < 1 + 4
    assert Priority(aging_s=0.5).key(b) < Priority(aging_s=0.5).key(a)
    with pytest.raises(ValueError, match="aging_s"):
        Priority(aging_s=0)
    with pytest.raises(ValueError, match="queue policy"):
        make_queue_policy("lifo")
    with pytest.raises(ValueError, match="priority"):
        Request("x", [1], 1, priority=1.5)
    assert Request("x", [1], 1, priority=2).copy().priority == 2


class CountingSJF(SJF):
    """SJF that counts how often it is asked for a key; ``static`` as given."""

    def __init__(self, static: bool):
        self.static, self.calls = static, 0

    def key(self, request):
        self.calls += 1
        return super().key(request)


@pytest.mark.parametrize("scheduler_cls", [OrcaScheduler, PagedScheduler, PrefillFirstScheduler,
                                           ChunkedPrefillScheduler])
def test_a_static_policys_keys_are_computed_once_per_request(scheduler_cls):
    """A static policy (its keys fixed at arrival) is asked once per request, however many steps
    sort the queues; the schedule is the one the same policy gives when asked every time."""
    runs = {}
    for static in (True, False):
        reqs = stream_with_one_low(low_prompt=40, n_stream=60)
        counting = CountingSJF(static)
        engine = Engine(scheduler_cls(max_num_seqs=2, queue_policy=counting), SimExecutor(), SimClock())
        engine.generate(reqs)
        runs[static] = (counting.calls, [(r.request_id, r.first_scheduled_time_s, r.finish_time_s) for r in reqs])
        # finished requests leave no order-of-service state behind (a server runs for days)
        assert not engine.scheduler._keys and not engine.scheduler._arrival_order
    assert runs[True][0] == len(reqs)
    assert runs[False][0] > 10 * len(reqs)  # every step's sort asks again
    assert runs[True][1] == runs[False][1]
    assert all(p.static for p in (FCFS(), SJF(), Priority()))
