"""metrics.py on hand-built timelines (every number below is worked out by hand)."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch import Request, RequestStatus, SamplingParams, SimClock, SimExecutor, make_engine
from minibatch.engine import StepRecord
from minibatch.records import StepEntry
from minibatch.metrics import SLO, request_metrics, summarize
from minibatch.records import (kv_waste_fraction, measured_decode_utilization, mean_batch_size, padding_waste_fraction,
                               slot_utilization, utilization_formula)


def finished_request(request_id, arrival_s, token_times_s, num_prompt_tokens=4, first_scheduled_s=None):
    """A request as the engine leaves it: one output token per token time, finished at the last."""
    r = Request(request_id, [11] * num_prompt_tokens, max_new_tokens=len(token_times_s),
                arrival_time_s=arrival_s)
    r.output_token_ids = [5] * len(token_times_s)
    r.token_times_s = list(token_times_s)
    r.first_scheduled_time_s = first_scheduled_s
    r.finish_time_s = token_times_s[-1]
    r.status, r.finish_reason = RequestStatus.FINISHED, "length"
    return r


@pytest.fixture
def three_requests():
    # A: TTFT 1.0, E2E 3.0, TPOT 2/3, ITL [0.5, 0.5, 1.0], queued 0.25
    # B: TTFT 2.0, E2E 2.0, TPOT none (1 token), ITL [], queued 1.0
    # C: TTFT 0.5, E2E 3.0, TPOT 1.25, ITL [1.0, 1.5], queued 0.0
    return [
        finished_request("A", 0.0, [1.0, 1.5, 2.0, 3.0], num_prompt_tokens=4, first_scheduled_s=0.25),
        finished_request("B", 0.5, [2.5], num_prompt_tokens=2, first_scheduled_s=1.5),
        finished_request("C", 1.0, [1.5, 2.5, 4.0], num_prompt_tokens=6, first_scheduled_s=1.0),
    ]


def test_request_metrics_by_hand(three_requests):
    a, b, c = request_metrics(three_requests)
    assert (a.request_id, a.ttft_s, a.e2e_s, a.itl_s) == ("A", 1.0, 3.0, [0.5, 0.5, 1.0])
    assert a.tpot_s == pytest.approx(2.0 / 3.0)
    assert (b.ttft_s, b.e2e_s, b.tpot_s, b.itl_s) == (2.0, 2.0, None, [])
    assert (c.ttft_s, c.e2e_s, c.tpot_s, c.itl_s) == (0.5, 3.0, 1.25, [1.0, 1.5])
    assert [m.queueing_delay_s for m in (a, b, c)] == [0.25, 1.0, 0.0]
    assert [(m.num_prompt_tokens, m.num_output_tokens) for m in (a, b, c)] == [(4, 4), (2, 1), (6, 3)]


def test_summary_throughput_and_percentiles(three_requests):
    s = summarize(three_requests)
    assert s.num_requests == 3
    assert s.duration_s == 4.0  # first arrival 0.0 -> last finish 4.0
    assert s.request_throughput_req_s == 0.75
    assert s.output_throughput_tok_s == 2.0  # 8 output tokens
    assert s.total_throughput_tok_s == 5.0  # 12 prompt + 8 output tokens
    # TTFT [0.5, 1.0, 2.0]: linear interpolation at rank 0.9 * 2 = 1.8 -> 1.0 + 0.8 * 1.0
    assert (s.ttft_mean_s, s.ttft_p50_s) == (pytest.approx(7 / 6), 1.0)
    assert (s.ttft_p90_s, s.ttft_p99_s) == (pytest.approx(1.8), pytest.approx(1.98))
    # TPOT [2/3, 1.25] (B has one token: left out)
    assert s.tpot_mean_s == pytest.approx((2 / 3 + 1.25) / 2) == s.tpot_p50_s
    assert s.tpot_p90_s == pytest.approx(2 / 3 + 0.9 * (1.25 - 2 / 3))
    # ITL pooled [0.5, 0.5, 1.0, 1.0, 1.5]: rank 0.9 * 4 = 3.6 -> 1.0 + 0.6 * 0.5
    assert (s.itl_mean_s, s.itl_p50_s) == (pytest.approx(0.9), 1.0)
    assert (s.itl_p90_s, s.itl_p99_s) == (pytest.approx(1.3), pytest.approx(1.48))
    # E2E [2.0, 3.0, 3.0]
    assert (s.e2e_mean_s, s.e2e_p50_s, s.e2e_p90_s, s.e2e_p99_s) == (pytest.approx(8 / 3), 3.0, 3.0, 3.0)
    assert s.queueing_delay_mean_s == pytest.approx(1.25 / 3)
    assert s.goodput_req_s is None and s.num_steps is None
    assert json.loads(json.dumps(s.to_dict()))["ttft_p50_s"] == 1.0


def test_percentiles_match_numpy_linear(three_requests):
    s = summarize(three_requests)
    itl = [0.5, 0.5, 1.0, 1.0, 1.5]
    assert s.itl_p99_s == pytest.approx(float(np.percentile(itl, 99, method="linear")))


@pytest.mark.parametrize("slo, num_good", [
    (SLO(ttft_s=1.0), 2),  # A (1.0 <= 1.0 counts) and C
    (SLO(tpot_s=1.0), 2),  # A and B (a 1-token output counts as TPOT 0, as in vLLM)
    (SLO(ttft_s=1.0, tpot_s=1.0), 1),  # A only: every SLO must hold
    (SLO(e2e_s=2.5), 1),  # B only
    (SLO(), 3),
])
def test_goodput(three_requests, slo, num_good):
    s = summarize(three_requests, slo=slo)
    assert s.num_good_requests == num_good
    assert s.goodput_req_s == num_good / 4.0
    assert s.to_dict()["slo"]["tpot_s"] == slo.tpot_s


def test_slo_validation():
    with pytest.raises(ValueError, match="ttft_s"):
        SLO(ttft_s=0.0)


def test_unfinished_request_is_named(three_requests):
    running = Request("still-running", [1, 2], max_new_tokens=4)
    running.token_times_s, running.output_token_ids = [0.5], [9]
    with pytest.raises(ValueError, match="still-running"):
        request_metrics([running])
    with pytest.raises(ValueError, match="still-running"):
        summarize(three_requests + [running])
    with pytest.raises(ValueError, match="at least one"):
        summarize([])


def record(step, entries, num_padding_tokens, num_idle_rows, used=0, reserved=0):
    return StepRecord(step, float(step), float(step + 1), entries, num_padding_tokens, num_idle_rows,
                      used, reserved, num_waiting=0, num_running=len(entries))


def test_trace_metrics_static_batch_by_hand():
    # batch_size 3: A (prompt 4, 3 tokens) and B (prompt 2, 1 token) in slots 0, 1; slot 2 idle.
    trace = [
        record(0, [StepEntry("A", 0, "prefill", 4, 0), StepEntry("B", 1, "prefill", 2, 0)], 2, 1, 8, 10),
        record(1, [StepEntry("A", 0, "decode", 1, 4), StepEntry("B", 1, "padding", 1, 2)], 1, 1, 10, 10),
        record(2, [StepEntry("A", 0, "decode", 1, 5), StepEntry("B", 1, "padding", 1, 2)], 1, 1, 12, 20),
    ]
    assert padding_waste_fraction(trace) == pytest.approx(4 / 12)  # 2 left-pad + 2 rows / (8 + 4)
    assert slot_utilization(trace) == pytest.approx(4 / 9)  # busy rows 4 of 3 steps x 3 slots
    assert mean_batch_size(trace) == pytest.approx(4 / 3)
    assert kv_waste_fraction(trace) == pytest.approx(1 - 30 / 40)
    assert measured_decode_utilization(trace) == pytest.approx(4 / 6) == utilization_formula([3, 1])
    requests = [finished_request("A", 0.0, [1.0, 2.0, 3.0]), finished_request("B", 0.0, [1.0])]
    s = summarize(requests, trace=trace)
    assert (s.num_steps, s.padding_waste_fraction) == (3, pytest.approx(1 / 3))
    assert (s.slot_utilization, s.mean_batch_size) == (pytest.approx(4 / 9), pytest.approx(4 / 3))


def test_chunked_prefill_counts_one_token_producing_row():
    trace = [
        record(0, [StepEntry("A", 0, "prefill", 4, 0)], 0, 0),
        record(1, [StepEntry("A", 0, "prefill", 4, 4), StepEntry("B", 1, "prefill", 2, 0)], 0, 0),
        record(2, [StepEntry("A", 0, "decode", 1, 8), StepEntry("B", 1, "padding", 1, 2)], 1, 0),
    ]
    # token-producing rows: A's last chunk, A's decode, B's prefill = 3; padding rows 1
    assert measured_decode_utilization(trace) == pytest.approx(3 / 4)


def test_utilization_formula():
    assert utilization_formula([3, 7, 1, 5]) == pytest.approx(4 / 7)
    assert utilization_formula([5]) == 1.0
    with pytest.raises(ValueError, match="output_lens"):
        utilization_formula([])


def run_policy(policy, output_lens, **kw):
    rows = len(output_lens)
    engine = make_engine(policy, SimExecutor(), SimClock(), config={"batch_size": rows, "max_num_seqs": rows}, **kw)
    requests = [Request(f"req-{i}", [3 + i] * (4 + i), max_new_tokens=n, sampling=SamplingParams(ignore_eos=True))
                for i, n in enumerate(output_lens)]
    return engine.generate(requests), engine.trace


def test_static_batch_measured_equals_formula():
    output_lens = [3, 7, 1, 5]
    requests, trace = run_policy("static", output_lens)
    assert [r.num_output_tokens for r in requests] == output_lens
    assert len(trace) == max(output_lens)  # one prefill step (token 1) + max - 1 decode steps
    assert measured_decode_utilization(trace) == pytest.approx(utilization_formula(output_lens))
    s = summarize(requests, trace)
    assert s.padding_waste_fraction > 0 and s.num_steps == 7
    assert len({m.ttft_s for m in request_metrics(requests)}) == 1  # one shared prefill step


def test_orca_has_no_padding():
    requests, trace = run_policy("orca", [3, 7, 1, 5])
    assert measured_decode_utilization(trace) == 1.0
    assert summarize(requests, trace).padding_waste_fraction == 0.0


@settings(max_examples=60, deadline=None)
@given(arrival_s=st.floats(0.0, 100.0), first_gap_s=st.floats(0.0, 10.0),
       gaps_s=st.lists(st.floats(0.0, 5.0), min_size=0, max_size=30))
def test_latency_identities(arrival_s, first_gap_s, gaps_s):
    times = list(np.cumsum([arrival_s + first_gap_s] + gaps_s))
    (m,) = request_metrics([finished_request("P", arrival_s, times)])
    assert len(m.itl_s) == len(times) - 1
    assert sum(m.itl_s) == pytest.approx(m.e2e_s - m.ttft_s, abs=1e-9)
    if m.tpot_s is None:
        assert len(times) == 1
    else:
        assert m.tpot_s * (len(times) - 1) + m.ttft_s == pytest.approx(m.e2e_s, abs=1e-9)
