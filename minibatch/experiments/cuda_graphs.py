"""CUDA graphs for decode steps (``runner.cuda_graphs``) measured against eager steps: decode steps timed on
ModelRunners that share one model (``benchmarks/cuda_graphs.py`` and gpu-check's ``cuda-graphs`` step).

RUNNERS are the ways a step runs: ``triton`` (decode steps replayed from CUDA graphs), ``triton_eager`` (the same
kernels, ``enforce_eager=True``) and ``sdpa`` (eager, blocks gathered by torch).
"""

from __future__ import annotations

RUNNERS = {"triton": dict(attention_backend="triton"),
           "triton_eager": dict(attention_backend="triton", enforce_eager=True),
           "sdpa": dict(attention_backend="sdpa")}


def graph_step_times(model, tokenizer, n: int, context: int, steps: int) -> dict:
    """Median ms of a decode step of ``n`` requests at ``context`` tokens on each of RUNNERS (steps alternating,
    ``experiment.alternating_step_ms``), the speedups of the graphs, and what the graph runner recorded (its sizes,
    replays, and why it stopped recording, if it did)."""
    from minibatch.experiment import alternating_step_ms, decoding_engine
    from minibatch.runner import ModelRunner

    engines = {name: decoding_engine(ModelRunner(model, tokenizer, **kw), [context] * n, steps + 8)
               for name, kw in RUNNERS.items()}
    ms = alternating_step_ms(engines, steps)
    graphs = engines["triton"].executor.decode_graphs
    return {"batch": n, "context": context, "step_ms": ms, "graph_speedup": round(ms["triton_eager"] / ms["triton"], 2),
            "speedup_over_sdpa": round(ms["sdpa"] / ms["triton"], 2), "graphs_recorded": sorted(graphs.graphs),
            "graph_replays": graphs.replays, "disabled": graphs.disabled}
