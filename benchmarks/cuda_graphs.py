"""CUDA graphs for decode steps (``runner.cuda_graphs``) against eager steps, on a CUDA GPU, at two levels:

* ``steps``: whole decode steps of ``--batches`` requests at ``--context`` tokens each, on ModelRunners that share
  one model and differ only in how a step runs: ``triton`` (its decode steps replayed from CUDA graphs),
  ``triton_eager`` (the same kernels, ``enforce_eager=True``) and ``sdpa`` (eager, the blocks gathered by torch);
  steps alternate between the runners; medians of ``--steps``;
* ``trace``: one saturated trace (``--num-requests`` ShareGPT-length requests at t = 0, ignore_eos, the gpu-check
  benchmark's caps) through ``paged`` on each runner and through HF ``generate`` (padded static batches) at the same
  batch cap (64), each after an untimed run of the trace's first 16 requests (first-call costs, the graphs of most
  sizes); output throughput, and whether each run's tokens equal the graph run's (bf16: other kernels round
  differently; ``tests/test_cuda.py`` checks them against HF ``generate`` by the equivalence rules).

    python benchmarks/cuda_graphs.py --json data/gpu/cuda_graphs_h200.json

Needs a CUDA GPU (and Triton); the model defaults to ``smollm2-135m-random`` (SmolLM2-135M's shape, seeded random
weights: a GPU machine without the real weights).
"""

from __future__ import annotations

import sys

import torch

from minibatch.checks import OneLineParser, int_arg, ints_arg, output_file_arg
from minibatch.experiments.cuda_graphs import RUNNERS, graph_step_times
from minibatch.report import environment, machine_load, write_json

CAP = 64  # the batch cap of the trace's runs (gpu-check's GPU benchmark)


def trace_run(model, tokenizer, num_requests: int) -> dict:
    """Output tokens/s of ``paged`` on each runner and of HF generate on one saturated trace."""
    from minibatch.clock import WallClock
    from minibatch.experiment import run
    from minibatch.runner import ModelRunner
    from minibatch.runner.support import config_max_model_len
    from minibatch.workload import make_trace

    limit = config_max_model_len(model.config.get_text_config())  # (a small test model's context is shorter)
    requests = make_trace(num_requests, arrival="zero", max_prompt_len=min(1024, limit // 2),
                          max_output_len=min(512, limit // 4), output_scale=0.5, vocab_size=model.config.vocab_size,
                          seed=0)
    n_slots = sum(r.num_prompt_tokens + r.max_new_tokens for r in requests) + CAP * 16  # no preemption
    out, tokens = {}, {}
    for name, kw in [*RUNNERS.items(), ("hf_generate", None)]:
        runner = ModelRunner(model, tokenizer, **(kw or RUNNERS["sdpa"]))
        policy = "paged" if kw is not None else "hf_generate"
        config = {"max_num_seqs": CAP, "n_slots": n_slots} if kw is not None else {"batch_size": CAP}
        run(policy, requests[:CAP // 4], runner, WallClock(runner.device), config=config)  # warm-up, not timed
        result = run(policy, requests, runner, WallClock(runner.device), config=config)
        out[name] = round(result.row()["output_throughput_tok_s"], 1)
        tokens[name] = [r.output_token_ids for r in result.requests]
    return {"num_requests": num_requests, "num_prompt_tokens": sum(r.num_prompt_tokens for r in requests),
            "num_output_tokens": sum(r.max_new_tokens for r in requests), "output_throughput_tok_s": out,
            "graph_speedup": round(out["triton"] / out["triton_eager"], 2),
            "triton_over_hf_generate": round(out["triton"] / out["hf_generate"], 2),
            "same_tokens_as_triton": {n: tokens[n] == tokens["triton"] for n in tokens if n != "triton"}}


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m-random")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--batches", type=ints_arg(1, 256), default=(1, 8, 32, 64), help="decode batch sizes")
    p.add_argument("--context", type=int_arg(1, 8192), default=256, help="tokens of context per request")
    p.add_argument("--steps", type=int_arg(1, 100_000), default=30, help="timed decode steps per runner")
    p.add_argument("--num-requests", type=int_arg(0, 4096), default=64, help="the trace's requests (0: no trace)")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (CUDA graphs record GPU work)")
    from minibatch.models import load_model

    model, tokenizer = load_model(args.model, device="cuda", dtype=args.dtype)
    load_before = machine_load()
    rows = []
    for n in args.batches:
        rows.append(graph_step_times(model, tokenizer, n, args.context, args.steps))
        print(rows[-1], flush=True)
    trace = trace_run(model, tokenizer, args.num_requests) if args.num_requests else None
    print(trace)
    result = {"command": "python benchmarks/cuda_graphs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": environment(load_before), "model": args.model, "dtype": args.dtype,
              "steps": rows, "trace": trace}
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
