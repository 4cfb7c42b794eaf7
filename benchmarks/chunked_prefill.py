"""Chunked prefill (Sarathi-Serve, Agrawal et al. OSDI'24) measured on a real model: notebook 05's
experiments on the wall clock, written to JSON.

    python benchmarks/chunked_prefill.py --model smollm2-135m --json data/cpu/chunked_prefill.json
    python benchmarks/chunked_prefill.py --model tiny-random-llama --quick     (a smoke test, seconds)

1. long-prompt trace: ``python -m minibatch compare``'s ShareGPT-length chats with
   --long-prompts prompts of --long-prompt-len tokens spread over the trace, arriving at --rate
   (fast enough that a queue forms: throughput measures the server, not the arrivals).
   prefill_first (vLLM v0: a step is all prefill or all decode), paged (whole prefills mixed
   with decodes) and chunked at each --budgets, plus the adaptive chunker at each
   --target-itl-ms. Reports ITL / TPOT / TTFT p50 and p99 and output throughput, and compares each chunked
   run with prefill_first ("versus_prefill_first"): whether its ITL p99 is at least 2x lower with output
   throughput within 10%.
2. prefill micro-batching: the same chats without long prompts, prefill_first with one prompt
   per prefill step vs as many as fit.

Every experiment checks that its runs produced the same greedy tokens. The functions are
``minibatch.experiments.chunked``'s; notebook 05 runs them on SimClock.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from minibatch import SimClock
from minibatch.compare import CompareConfig, build_trace
from minibatch.experiment import load_runner, run
from minibatch.experiments import chunked
from minibatch.checks import (MAX_KV_SLOTS, MAX_NUM_REQUESTS, MAX_NUM_SEQS, MAX_RATE, MAX_SECONDS, MAX_TOKENS,
                              MIN_RATE, OneLineParser, check_not_given, device_arg, int_arg, ints_arg, output_file_arg,
                              real_arg, reals_arg)
from minibatch.claims import claim
from minibatch.lessons.chunked_prefill import CLAIM_IDS, fold, print_table, print_versus
from minibatch.report import environment, machine_load, write_json


def or_none(parse):
    """An argparse ``type``: a comma-separated list as ``parse`` reads it, or () for '' (none)."""
    return lambda text: parse(text) if text.strip() else ()


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny-random-llama, a local dir or hub id")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="smoke test: 8 requests, short prompts (tiny-random-llama)")
    p.add_argument("--clock", default="wall", choices=["wall", "sim"], help="wall: measured; sim: cost model")
    p.add_argument("--num-requests", type=int_arg(1, MAX_NUM_REQUESTS), default=32)
    p.add_argument("--rate", type=real_arg(MIN_RATE, MAX_RATE), default=8.0, help="arrivals, requests/s (Poisson)")
    p.add_argument("--long-prompts", type=int_arg(0, MAX_NUM_REQUESTS), default=4, help="requests with a long prompt")
    p.add_argument("--long-prompt-len", type=int_arg(1, MAX_TOKENS), default=1536, help="tokens per long prompt")
    p.add_argument("--budgets", type=or_none(ints_arg(1, MAX_TOKENS)), default="64,128,256,512",
                   help="chunked token budgets (max_num_batched_tokens; comma-separated; '' = none)")
    p.add_argument("--target-itl-ms", type=or_none(reals_arg(0, MAX_SECONDS * 1e3, low_open=True)), default="150",
                   help="adaptive chunker targets, ms (comma-separated; '' = none)")
    p.add_argument("--max-num-seqs", type=int_arg(1, MAX_NUM_SEQS), default=32,
                   help="most running requests (max_num_seqs)")
    p.add_argument("--n-slots", type=int_arg(1, MAX_KV_SLOTS), default=16384,
                   help="KV token slots (large: no preemption)")
    p.add_argument("--seed", type=int_arg(0, 2**32 - 1), default=0)
    p.add_argument("--skip-micro-batching", action="store_true")
    p.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int_arg(1, 1024), default=None,
                   help="torch CPU threads (recorded in the JSON either way)")
    args = p.parse_args(argv)
    if args.quick:
        check_not_given(p, args, ("num_requests", "long_prompts", "long_prompt_len", "budgets"),
                        "with --quick, which sets it")
    args.command = " ".join(["python benchmarks/chunked_prefill.py"] + (argv if argv is not None else sys.argv[1:]))
    return args


def versus_baseline(rows: list[dict], baseline: str = "prefill_first") -> list[dict]:
    """For each chunked run: ITL p99 and TPOT p99 reduction vs the baseline (baseline / run, > 1: lower),
    throughput ratio (run / baseline), and whether ITL p99 is at least 2x lower with throughput within 10%."""
    base = next(r for r in rows if r["policy"] == baseline)
    out = []
    for r in rows:
        if r["budget"] is None:
            continue
        out.append({"run": r["policy"], "itl_p99_reduction_x": base["itl_p99_s"] / r["itl_p99_s"],
                    "tpot_p99_reduction_x": base["tpot_p99_s"] / r["tpot_p99_s"],
                    "throughput_ratio": r["output_throughput_tok_s"] / base["output_throughput_tok_s"],
                    "itl_p99_halved_within_10pct_throughput": base["itl_p99_s"] / r["itl_p99_s"] >= 2
                    and r["output_throughput_tok_s"] >= 0.9 * base["output_throughput_tok_s"]})
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = machine_load()  # how busy the machine was: recorded with the result
    t_start = time.perf_counter()
    if args.quick:
        args.num_requests, args.long_prompts, args.long_prompt_len, args.budgets = 8, 1, 200, (16, 64)
    budgets = list(args.budgets)
    targets = [t / 1e3 for t in args.target_itl_ms]
    cfg = CompareConfig(model=args.model, num_requests=args.num_requests, rate=args.rate, seed=args.seed,
                        long_prompts=args.long_prompts, long_prompt_len=args.long_prompt_len,
                        max_prompt_len=64 if args.quick else 256, max_output_len=16 if args.quick else 256)
    model, tokenizer, runner, clock = load_runner(args.model, args.device, args.clock, args.threads)  # cfg checked
    trace = build_trace(cfg, tokenizer, model.config.vocab_size)
    for policy in ("prefill_first", "paged", "chunked"):  # warm-up: no run pays first-call costs
        run(policy, trace[:2], runner, SimClock(), **chunked.ENGINE_DEFAULTS)
    result = {"command": args.command, "environment": environment(), "model": args.model, "clock": args.clock,
              "device": args.device, "trace": {"num_requests": len(trace), "rate_per_s": args.rate,
                                               "long_prompts": args.long_prompts,
                                               "long_prompt_len": args.long_prompt_len,
                                               "prompt_tokens": sum(r.num_prompt_tokens for r in trace),
                                               "output_tokens": sum(r.max_new_tokens for r in trace)},
              "max_num_seqs": args.max_num_seqs, "n_slots": args.n_slots, "claims": list(CLAIM_IDS)}
    print(f"trace: {len(trace)} requests ({args.long_prompts} x {args.long_prompt_len}-token prompts), "
          f"{result['trace']['prompt_tokens']} prompt + {result['trace']['output_tokens']} output tokens")

    t = time.perf_counter()
    rows = chunked.budget_sweep(trace, runner, clock, budgets, baselines=("prefill_first", "paged"),
                                target_itl_s=targets, max_num_seqs=args.max_num_seqs, n_slots=args.n_slots)
    print_table(rows)
    versus = versus_baseline(rows)
    result["long_prompt"] = {"rows": rows, "versus_prefill_first": versus, "run_time_s": time.perf_counter() - t}
    print_versus(versus)
    print("ITL p99 at least 2x lower with throughput within 10%: "
          + (", ".join(v["run"] for v in versus if v["itl_p99_halved_within_10pct_throughput"]) or "none"))
    print(f"same outputs in every run: {rows[0]['same_outputs']}")

    if not args.skip_micro_batching:
        t = time.perf_counter()
        plain = [r for r in build_trace(CompareConfig(**{**cfg.__dict__, "long_prompts": 0}), tokenizer,
                                        model.config.vocab_size)]
        mb = chunked.micro_batching_experiment(plain, runner, clock, max_num_seqs=args.max_num_seqs,
                                               n_slots=args.n_slots)
        print_table(mb)
        one, batched = mb
        result["micro_batching"] = {"rows": mb, "run_time_s": time.perf_counter() - t,
                                    "ttft_p50_x": one["ttft_p50_s"] / batched["ttft_p50_s"],
                                    "throughput_x": batched["output_throughput_tok_s"] / one["output_throughput_tok_s"]}
        print(f"batched prefills: TTFT p50 {fold(one['ttft_p50_s'], batched['ttft_p50_s'])}, output throughput "
              f"{result['micro_batching']['throughput_x']:.2f}x; same outputs: {mb[0]['same_outputs']}")
        print(f"  published: {claim('winechord-micro-batching').cite()}")

    result["run_time_s"] = time.perf_counter() - t_start
    result["environment"] = environment(load_before)
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
