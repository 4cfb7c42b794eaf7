"""Golden schedules: every policy on three traces, on the simulated clock, recorded to JSON.

The step contract and the policy table may be refactored freely; what a schedule *is* may not
change. ``tests/test_golden.py`` runs these cases and compares them with ``tests/golden/*.json.gz``;
``python tests/golden_runs.py`` writes the files again (only when a change is meant to alter
schedules, and the diff is then part of the review).

Each case is (trace, policy, options, executor): SimExecutor runs (made-up tokens) cover every
policy and option; a tiny random-init model covers the real runner and the speculative runner.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

GOLDEN_DIR = Path(__file__).parent / "golden"
TRACES = ("poisson", "shared_prefix", "kv_pressure")

# (name, policy, make_engine options, SimExecutor options or None for the tiny model)
SIM_CASES = [
    ("static", "static", dict(batch_size=4, max_wait_s=0.5), {}),
    ("orca", "orca", dict(max_num_seqs=8), {}),
    ("orca_max", "orca", dict(max_num_seqs=8, reserve_new_tokens=64), {}),
    ("paged", "paged", dict(max_num_seqs=8), {}),
    ("paged_swap", "paged", dict(max_num_seqs=8, preemption_mode="swap"), {}),
    ("paged_sjf", "paged", dict(max_num_seqs=8, queue_policy="sjf"), {}),
    ("paged_prefix", "paged_prefix", dict(max_num_seqs=8), {}),
    ("prefill_first", "prefill_first", dict(max_num_seqs=8, max_num_prefills=2), {}),
    ("chunked", "chunked", dict(max_num_seqs=8, max_num_batched_tokens=64), {}),
    ("chunked_prefix", "chunked_prefix", dict(max_num_seqs=8, max_num_batched_tokens=64), {}),
    ("chunked_adaptive", "chunked", dict(max_num_seqs=8, target_itl_s=0.12), {}),  # the chunker sets each budget
    ("spec", "spec", dict(max_num_seqs=8, num_speculative_tokens=3),
     dict(acceptance_rate=0.7, seed=3, draft_catch_up=True)),
    ("spec_adaptive", "spec", dict(max_num_seqs=8, num_speculative_tokens=6, adaptive_k=True),
     dict(acceptance_rate=0.8, seed=3, draft_catch_up=True)),
    ("spec_ngram", "spec_ngram", dict(max_num_seqs=8, num_speculative_tokens=3),
     dict(acceptance_rate=[0.8, 0.5, 0.2], seed=4, draft_forwards=False, proposal_rate=0.6)),
]
MODEL_CASES = [  # on tiny-random-llama (real tokens), trace "poisson" only
    ("model_static", "static", dict(batch_size=4, max_wait_s=0.5)),
    ("model_paged", "paged", dict(max_num_seqs=8)),
    ("model_chunked", "chunked", dict(max_num_seqs=8, max_num_batched_tokens=32)),
    ("model_spec", "spec", dict(max_num_seqs=8, num_speculative_tokens=3)),
    ("model_spec_ngram", "spec_ngram", dict(max_num_seqs=8, num_speculative_tokens=3)),
]


def make_requests(trace: str, vocab_size: int = 200):
    """The three traces: Poisson ShareGPT-like lengths; a burst sharing a system prompt; long
    prompts arriving together into a small KV cache (preemption)."""
    import numpy as np

    from minibatch.request import Request, SamplingParams
    from minibatch.workload import make_trace

    greedy = SamplingParams(ignore_eos=True)
    rng = np.random.default_rng({"poisson": 1, "shared_prefix": 2, "kv_pressure": 3}[trace])
    if trace == "poisson":
        return make_trace(14, rate_per_s=6.0, lengths="uniform", prompt_range=(4, 40), output_range=(2, 24),
                          vocab_size=vocab_size, seed=5)
    if trace == "shared_prefix":
        system = rng.integers(3, vocab_size, size=40).tolist()
        return [Request(f"p{i:02d}", system + rng.integers(3, vocab_size, size=int(rng.integers(1, 20))).tolist(),
                        int(rng.integers(2, 16)), greedy, arrival_time_s=0.05 * i) for i in range(12)]
    return [Request(f"k{i:02d}", rng.integers(3, vocab_size, size=int(rng.integers(40, 120))).tolist(),
                    int(rng.integers(20, 60)), greedy, arrival_time_s=0.02 * i) for i in range(10)]


def n_slots(trace: str) -> int:
    return 320 if trace == "kv_pressure" else 1024


def record_dict(rec) -> dict:
    """A StepRecord in the golden format (the fields the schedule is made of, rounded times)."""
    return {
        "step": rec.step, "start_s": round(rec.start_s, 9), "end_s": round(rec.end_s, 9),
        "entries": [[e.request_id, e.row, e.phase, e.num_new_tokens, e.num_computed_tokens, e.sampled,
                     e.num_spec_tokens, e.num_accepted_tokens] for e in rec.entries],
        "num_padding_tokens": rec.num_padding_tokens, "num_idle_rows": rec.num_idle_rows,
        "num_kv_slots_used": rec.num_kv_slots_used, "num_kv_slots_reserved": rec.num_kv_slots_reserved,
        "num_waiting": rec.num_waiting, "num_running": rec.num_running, "finished": list(rec.finished),
        "block_tables": {k: list(v) for k, v in rec.block_tables.items()}, "preempted": list(rec.preempted),
        "draft_time_s": round(rec.draft_time_s, 9),
    }


def run_case(trace: str, policy: str, options: dict, executor) -> dict:
    from minibatch.clock import SimClock
    from minibatch.policies import make_engine

    requests = make_requests(trace, executor.vocab_size or 200)
    engine = make_engine(policy, executor, SimClock(), config={"n_slots": n_slots(trace)}, **options)
    engine.generate(requests)
    return {"steps": [record_dict(r) for r in engine.trace],
            "outputs": {r.request_id: r.output_token_ids for r in requests}}


def sim_executor(sim_options: dict):
    from minibatch.sim.executor import SimExecutor

    return SimExecutor(vocab_size=200, **sim_options)


def load_golden(trace: str) -> dict:
    return json.loads(gzip.decompress((GOLDEN_DIR / f"{trace}.json.gz").read_bytes()))


def golden_runs(trace: str, model=None) -> dict:
    """name -> {"steps": [...], "outputs": {...}} for every case on ``trace``; ``model`` (a
    tiny-random-llama ModelRunner factory) adds the model cases on the poisson trace."""
    runs = {name: run_case(trace, policy, options, sim_executor(sim)) for name, policy, options, sim in SIM_CASES}
    if model is not None and trace == "poisson":
        for name, policy, options in MODEL_CASES:
            runner, draft = model()
            runs[name] = run_case(trace, policy, dict(options, draft_runner=draft) if policy == "spec" else options,
                                  runner)
    return runs


def tiny_model():
    """A factory of (ModelRunner, draft ModelRunner) on tiny-random-llama (the draft is the same model)."""
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner

    model, tok = load_model("tiny-random-llama")
    return lambda: (ModelRunner(model, tok), ModelRunner(model, tok))


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    GOLDEN_DIR.mkdir(exist_ok=True)
    factory = tiny_model()
    for trace in sys.argv[1:] or TRACES:
        path = GOLDEN_DIR / f"{trace}.json.gz"
        path.write_bytes(gzip.compress((json.dumps(golden_runs(trace, factory), separators=(",", ":")) + "\n").encode(),
                                       mtime=0))
        print(f"wrote {path}")
