"""What a forward costs on a real runner: AdaptiveK's verify_cost_ratio measured on this machine.

The ratio v of a verify forward (k+1 new tokens) to a plain decode (1) at batch 1: Leviathan et al., ICML'23 §3,
take v = 1 (the target checks k+1 tokens in the time of one); here it is measured instead of assumed.
"""

from __future__ import annotations


def forward_time_s(runner, num_new_tokens: int = 1, context: int = 128, repeats: int = 10) -> float:
    """Median seconds of one batch-1 packed forward of ``num_new_tokens`` tokens after ``context``
    cached tokens on ``runner`` (a ModelRunner). The measurement claims the runner's KV cache (and resizes it), as
    an engine does: an engine that used the runner before gets its own cache back at its next step.

    Raises:
        RuntimeError: an engine still holds KV in ``runner`` (running or swapped requests).
    """
    import time

    from minibatch.runner.batch import PackedSequence

    block_size, n = 16, context + num_new_tokens
    table = list(range(-(-n // block_size)))
    probe = _Measurement()
    runner.claim(probe, (len(table), block_size, 0))
    ids = [3 + i % 100 for i in range(n)]
    runner.forward_sequences([PackedSequence("m", ids[:context], 0, table, 1)])
    ts = []
    for _ in range(repeats + 2):  # two warm-up forwards
        t0 = time.perf_counter()
        runner.forward_sequences([PackedSequence("m", ids[context:], context, table, num_new_tokens)])
        ts.append(time.perf_counter() - t0)
    return sorted(ts[2:])[repeats // 2]


class _Measurement:
    """The owner of a runner's KV cache while :func:`forward_time_s` measures (it holds no request's KV)."""

    holds_kv = False


def measure_verify_cost(runner, k: int = 4, context: int = 128) -> float:
    """A verify forward's time (k+1 new tokens) over a plain decode's (1) on ``runner`` at batch 1:
    AdaptiveK's verify_cost_ratio v on this machine (1 in Leviathan et al., ICML'23 §3). Raises as
    :func:`forward_time_s`."""
    return forward_time_s(runner, k + 1, context) / forward_time_s(runner, 1, context)
