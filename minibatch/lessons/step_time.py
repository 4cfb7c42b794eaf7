"""Notebook 07b (where a step's time goes): the committed step profiles and the vLLM comparison as tables, and the
exercise check. The measuring itself is ``minibatch.experiments.step_profile`` (``python -m minibatch profile``)
and ``benchmarks/vllm_peer.py``; this module only reads their JSON.
"""

from __future__ import annotations

from minibatch.lessons import exercise


def shape_name(row: dict) -> str:
    """A profile row's shape as the tables name it: "decode 32" (its batch), "prefill 1024" (its tokens)."""
    return f"{row['kind']} {row['batch'] if row['kind'] == 'decode' else row['tokens']}"


def profile_rows(result: dict) -> list[dict]:
    """One dict per shape of a step profile: its name, step and bound times (ms), the bound's kind, step / bound,
    the Python and scheduling share and the three largest components with their shares."""
    rows = []
    for r in result["shapes"]:
        parts = r["components_s"]
        top = sorted(parts, key=parts.get, reverse=True)[:3]
        rows.append({"shape": shape_name(r),
                     "step_ms": round(r["step_s"] * 1e3, 1), "bound_ms": round(r["bound_s"] * 1e3, 1),
                     "bound": r["bound"], "step_over_bound": r["step_over_bound"],
                     "overhead_share": r["overhead_share"],
                     "top": ", ".join(f"{c} {parts[c] / r['profiled_step_s']:.0%}" for c in top)})
    return rows


def print_profile(result: dict) -> None:
    """The profile as a table (see :func:`profile_rows`)."""
    print(f"{result['model']}, {result['dtype']}, {result['attention_backend']} attention, {result['threads']} "
          f"threads; roofline: {result['roofline']['peak_flop_per_s'] / 1e9:.0f} GFLOP/s, "
          f"{result['roofline']['bytes_per_s'] / 1e9:.1f} GB/s")
    print(f"{'shape':<14}{'step ms':>9}{'bound ms':>10}{'bound':>9}{'x bound':>9}{'overhead':>10}  largest parts")
    for r in profile_rows(result):
        print(f"{r['shape']:<14}{r['step_ms']:>9}{r['bound_ms']:>10}{r['bound']:>9}{r['step_over_bound']:>9.1f}"
              f"{r['overhead_share']:>10.0%}  {r['top']}")


def backend_steps(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """backend -> shape -> step time (ms), from one profile per attention backend."""
    return {name: {shape_name(r): round(r["step_s"] * 1e3, 1)
                   for r in res["shapes"]} for name, res in results.items()}


def peer_rounds(result: dict) -> list[dict]:
    """The vLLM benchmark's rounds: our output tokens/s, vLLM's and transformers' and our ratio to each."""
    return [{k: (round(v, 1) if isinstance(v, float) and k.endswith("tok_s") else v) for k, v in line.items()
             if k.endswith(("tok_s", "_over_vllm", "_over_hf_generate_batch"))} for line in result["summary"]["rounds"]]


@exercise.check(hint="compare the step's FLOPs over the peak with its bytes over the bandwidth; a decode of one "
                     "request computes one token per weight it reads")
def check_regime(my_prediction, result: dict, shape: str = "decode 1", show_answer: bool = False):
    """``my_prediction``: "memory" or "compute", the roof that bounds ``shape`` in the profile ``result``."""
    row = next(r for r in profile_rows(result) if r["shape"] == shape)
    exercise.expect(my_prediction, row["bound"], "my_prediction", show_answer=show_answer)
    return f"{shape} is {row['bound']}-bound on this roofline"


def print_gpu_steps(result: dict) -> None:
    """A GPU step profile's launches: per shape, its kernels per step and the share of the step the GPU was busy."""
    for r in result["shapes"]:
        name = shape_name(r)
        print(f"{name:<14}{r['step_s'] * 1e3:>7.1f} ms  {r['kernels_per_step']} kernels, GPU busy "
              f"{r['device_busy_share']:.0%} of the step")


def print_graph_steps(result: dict) -> None:
    """``benchmarks/cuda_graphs.py``'s decode steps: per batch size, ms from CUDA graphs, eager with the same kernels
    and eager with ``sdpa``, and the graphs' speedup."""
    print(f"{'decode':<8}{'graphs ms':>10}{'eager ms':>10}{'sdpa ms':>9}{'speedup':>9}")
    for r in result["steps"]:
        ms = r["step_ms"]
        print(f"{r['batch']:<8}{ms['triton']:>10}{ms['triton_eager']:>10}{ms['sdpa']:>9}{r['graph_speedup']:>8}x")
