"""When speculative decoding pays: the batch-1 speedup model and a batch-size sweep on the simulated clock.

At batch 1 a verify forward over k+1 tokens costs ``verify_cost_ratio`` (v) plain decodes and a
draft forward ``draft_cost_ratio`` (c) of one, so the speedup is E[tokens](alpha, k) / (v + c k)
(Leviathan et al. 2023), where alpha is Leviathan's per-token acceptance probability, not vLLM's
acceptance rate (accepted / drafted, (alpha + ... + alpha^k) / k). A larger batch makes each step
compute-bound: verifying k+1 tokens per request then costs ~k+1 times a decode, so the speedup falls
and crosses 1.
Times are seconds on the simulated clock.
"""

from __future__ import annotations

from minibatch.checks import MAX_SPEC_TOKENS, check_int, check_real
from minibatch.clock import CostModel, SimClock
from minibatch.experiment import run
from minibatch.experiments.speculative import BLOCK_SIZE
from minibatch.request import Request, SamplingParams
from minibatch.sim.executor import SimExecutor
from minibatch.spec import expected_tokens, predicted_speedup


def sim_verify_cost_ratio(k: int = 4, context: int = 128, cost_model=None) -> float:
    """The simulated clock's verify-vs-decode step time at batch 1 (k+1 vs 1 new tokens; ``context``
    tokens already cached; cost_model: default the clock's CostModel)."""
    cm = cost_model or CostModel()
    return cm.forward_time_s(1, k + 1, context + k + 1) / cm.forward_time_s(1, 1, context + 1)


def break_even_alpha(k: int, verify_cost_ratio: float, draft_cost_ratio: float, target: float = 1.0) -> float:
    """The per-token alpha at which ``predicted_speedup`` reaches ``target`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_speedup(mid, k, verify_cost_ratio, draft_cost_ratio) < target else (lo, mid)
    return hi


def alpha_from_acceptance_length(mean_acceptance_length: float, k: int) -> float:
    """Leviathan's per-token alpha whose E[tokens](alpha, k) equals a measured mean acceptance length
    (tokens per verification of k drafts, SpecDecodingStats.mean_acceptance_length; bisection).

    Raises:
        ValueError: k outside 1..MAX_SPEC_TOKENS, or mean_acceptance_length outside [1, k + 1].
    """
    k = check_int(k, "k", 1, MAX_SPEC_TOKENS)
    target = check_real(mean_acceptance_length, "mean_acceptance_length", 1.0, k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < target else (lo, mid)
    return (lo + hi) / 2


def batch_sweep_sim(acceptance_rate: float = 0.7, ks=(2, 4), batch_sizes=(1, 2, 4, 8, 16, 32, 64),
                    prompt_len: int = 64, output_len: int = 128, cost_model=None, draft_cost_model=None) -> list[dict]:
    """Speedup of speculative decoding ("spec", fixed k) over plain decoding ("paged") vs batch size,
    on the simulated clock (SimExecutor: each draft token accepted independently with probability
    ``acceptance_rate``, i.e. Leviathan's per-token alpha); lengths in
    tokens. Rows: {batch_size, k, speedup, plain_s, spec_s}."""
    rows = []
    for B in batch_sizes:
        reqs = [Request(f"r{i}", [5 + i] * prompt_len, output_len, SamplingParams(ignore_eos=True)) for i in range(B)]
        n_slots = (B * (prompt_len + output_len) // BLOCK_SIZE + 16) * BLOCK_SIZE
        times = {}
        for k in (0, *ks):
            result = run("spec" if k else "paged", reqs, SimExecutor(acceptance_rate=acceptance_rate, seed=B),
                         SimClock(cost_model, draft_cost_model), max_num_seqs=B, n_slots=n_slots,
                         block_size=BLOCK_SIZE, **({"num_speculative_tokens": k} if k else {}))
            times[k] = result.engine.clock.now_s
        rows += [{"batch_size": B, "k": k, "speedup": times[0] / times[k], "plain_s": times[0], "spec_s": times[k]}
                 for k in ks]
    return rows
