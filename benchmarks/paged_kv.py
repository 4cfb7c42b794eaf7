"""Paged KV cache (vLLM, Kwon et al. SOSP'23) measured on a real model: every experiment of
notebook 04, on the wall clock, written to JSON.

    python benchmarks/paged_kv.py --model smollm2-135m --json data/cpu/paged_kv.json
    python benchmarks/paged_kv.py --model tiny-random-llama --quick          (a smoke test, seconds)

1. reservation vs paged: the default compare trace (``python -m minibatch compare``'s 32
   ShareGPT-length requests) under orca, paged and paged_prefix at each --n-slots, small enough
   that Orca's reservation limits admission; at the largest one also "orca_max", Orca reserving
   --orca-max-new-tokens per request as a server without an output-length oracle would.
2. prefix caching: a ~170-token system prompt + 8 user prompts, paged vs paged_prefix.
3. copy-on-write: n = 4 greedy samples of a ~200-token prompt, forked vs unshared.
4. preemption: the compare trace at --preemption-n-slots, recompute vs swap.
5. kernels: the Triton kernels vs their torch references (max abs diff; CPU: interpreter).

Every experiment's outputs are compared across its policies (same greedy tokens). The numbers
come from ``minibatch.experiments`` (kv_waste, kv_sharing, preemption, kernel_check); notebook 04
runs the same functions on SimClock.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from minibatch.checks import (MAX_BLOCK_SIZE, MAX_KV_SLOTS, MAX_NUM_SEQS, MAX_TOKENS, OneLineParser, device_arg,
                              int_arg, ints_arg, output_file_arg)
from minibatch.compare import CompareConfig, build_trace
from minibatch.experiment import load_runner, run
from minibatch.experiments import kv_sharing, kv_waste, preemption
from minibatch.experiments.kernel_check import kernel_check
from minibatch.experiments.paged_kv import GREEDY, variant_options
from minibatch.report import environment, machine_load, write_json
from minibatch.request import Request
from minibatch.viz.paged_kv import VLLM_CLAIM
from minibatch.prompts import demo_prompts


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny-random-llama, a local dir or hub id")
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 8 short requests, small n_slots, short outputs (use with tiny-random-llama)")
    p.add_argument("--clock", default="wall", choices=["wall", "sim"], help="wall: measured; sim: cost model")
    p.add_argument("--n-slots", type=ints_arg(1, MAX_KV_SLOTS), default=None,
                   help="comma-separated KV sizes in token slots (default 400,512,768)")
    p.add_argument("--orca-max-new-tokens", type=int_arg(1, MAX_TOKENS), default=None,
                   help="orca_max's reservation per request (default: the trace's max output length, 256)")
    p.add_argument("--preemption-n-slots", type=int_arg(1, MAX_KV_SLOTS), default=None,
                   help="KV slots for recompute vs swap (default 400)")
    p.add_argument("--block-size", type=int_arg(1, MAX_BLOCK_SIZE), default=16, help="paged KV block size, tokens")
    p.add_argument("--max-num-seqs", type=int_arg(1, MAX_NUM_SEQS), default=32,
                   help="most running requests (Orca's max_num_seqs, vLLM's max_num_seqs)")
    p.add_argument("--seed", type=int_arg(0, 2**32 - 1), default=0)
    p.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int_arg(1, 1024), default=None,
                   help="torch CPU threads (default: torch's choice; recorded in the JSON either way)")
    args = p.parse_args(argv)
    args.command = " ".join(["python benchmarks/paged_kv.py"] + (argv if argv is not None else sys.argv[1:]))
    return args


def fmt(row: dict, keys) -> str:
    cells = []
    for key, label, spec in keys:
        value = row.get(key)
        cells.append(f"{label} {'-' if value is None else format(value, spec)}")
    return "  ".join(cells)


METRICS = (("kv_waste_fraction", "KV waste", ".1%"), ("max_num_running", "max running", "d"),
           ("mean_batch_size", "mean batch", ".2f"), ("output_throughput_tok_s", "out tok/s", ".1f"),
           ("ttft_p50_s", "TTFT p50", ".3f"), ("ttft_p99_s", "p99", ".3f"), ("num_preemptions", "preempted", "d"))


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = machine_load()  # how busy the machine was: recorded with the result
    t_start = time.perf_counter()
    model, tokenizer, runner, clock = load_runner(args.model, args.device, args.clock, args.threads)
    if args.quick:
        # near-simultaneous arrivals, so that even a tiny model runs into memory pressure
        cfg = CompareConfig(model=args.model, num_requests=8, rate=100.0, max_prompt_len=48, max_output_len=16,
                            seed=args.seed)
    else:
        cfg = CompareConfig(model=args.model, seed=args.seed)
    requests = build_trace(cfg, tokenizer, model.config.vocab_size)
    longest = max(r.max_num_tokens for r in requests)
    tight = (-(-longest // args.block_size) + 1) * args.block_size  # the longest request's blocks + one
    n_slots_list = (list(args.n_slots) if args.n_slots else
                    [tight, 2 * tight] if args.quick else [400, 512, 768])
    orca_max_new = args.orca_max_new_tokens or cfg.max_output_len
    preempt_n_slots = args.preemption_n_slots or (tight if args.quick else 400)
    too_small = [n for n in n_slots_list + [preempt_n_slots] if n < tight]
    if too_small:
        raise ValueError(f"n_slots {too_small} cannot hold the longest request ({longest} tokens) in "
                         f"blocks of {args.block_size}")
    print(f"model {args.model} on {args.device}, {args.clock} clock; trace: {len(requests)} requests, "
          f"{sum(r.num_prompt_tokens for r in requests)} prompt + {sum(r.max_new_tokens for r in requests)} "
          f"output tokens, longest {longest}")
    _warm_up(runner, clock)

    result = {"command": args.command, "environment": environment(), "model": args.model, "device": args.device,
              "clock": args.clock, "quick": args.quick, "seed": args.seed, "block_size": args.block_size,
              "max_num_seqs": args.max_num_seqs, "claims": [VLLM_CLAIM["claim_id"]],
              "trace": {"num_requests": len(requests), "num_prompt_tokens": sum(r.num_prompt_tokens for r in requests),
                        "num_output_tokens": sum(r.max_new_tokens for r in requests), "longest_request_tokens": longest,
                        "max_output_len": cfg.max_output_len, "rate_per_s": cfg.rate},
              "expected_kv_waste": {
                  "orca": kv_waste.expected_kv_waste(requests, "orca"),
                  "orca_max": kv_waste.expected_kv_waste(requests, "orca_max", reserve_new_tokens=orca_max_new),
                  "paged": kv_waste.expected_kv_waste(requests, "paged", args.block_size)}}

    print("\n1. reservation vs paged (same trace, same KV memory)")
    t = time.perf_counter()
    rows = []
    for n_slots in n_slots_list:
        row = kv_waste.reservation_vs_paged(
            requests, runner, clock, n_slots, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
            orca_max_new_tokens=orca_max_new if n_slots == max(n_slots_list) else None)
        rows.append(row)
        for name, m in row["policies"].items():
            print(f"  n_slots {n_slots:>5} {name:<13} " + (m["skipped"] if "skipped" in m else fmt(m, METRICS)))
        print(f"  same outputs under every policy: {row['same_outputs']}")
    result["reservation_vs_paged"] = rows
    result["reservation_vs_paged_run_time_s"] = round(time.perf_counter() - t, 1)

    print("\n2. prefix caching (shared system prompt)")
    t = time.perf_counter()
    system_text = kv_sharing.SYSTEM_PROMPT[:120] if args.quick else kv_sharing.SYSTEM_PROMPT  # quick: tiny contexts
    system_ids, user_ids = kv_sharing.system_and_user_ids(tokenizer, system_text, demo_prompts()[:8])
    if args.quick:
        user_ids = [ids[:64] for ids in user_ids]
    prefix = kv_sharing.prefix_caching_experiment(runner, clock, system_ids, user_ids,
                                                  max_new_tokens=4 if args.quick else 16, gap_s=0.5,
                                                  block_size=args.block_size, n_slots=4096,
                                                  max_num_seqs=args.max_num_seqs)
    prefix["run_time_s"] = round(time.perf_counter() - t, 1)
    result["prefix_caching"] = prefix
    for name, m in prefix["policies"].items():
        print(f"  {name:<13} hit rate {m['prefix_cache_hit_rate']:.1%}  prefill tokens {m['num_prefill_tokens']}  "
              f"TTFT p50 {m['ttft_p50_s']:.3f} s  p99 {m['ttft_p99_s']:.3f} s")
    print(f"  system prompt {prefix['num_system_prompt_tokens']} tokens; same outputs: {prefix['same_outputs']}")

    print("\n3. copy-on-write (parallel sampling, n = 4, greedy)")
    t = time.perf_counter()
    prompt = _long_prompt(tokenizer, 40 if args.quick else 200)
    cow = kv_sharing.cow_experiment(runner, prompt, n=4, max_new_tokens=4 if args.quick else 16,
                                    block_size=args.block_size, n_slots=4096, clock_factory=clock)
    cow["run_time_s"] = round(time.perf_counter() - t, 1)
    result["copy_on_write"] = cow
    print(f"  prompt {cow['num_prompt_tokens']} tokens: peak {cow['peak_slots_forked']} slots forked vs "
          f"{cow['peak_slots_independent']} unshared, saved {cow['slots_saved']} "
          f"(expected {cow['expected_slots_saved']}) "
          f"= {cow['bytes_saved'] / 2**20:.2f} MiB; same outputs: {cow['same_outputs']}")

    print(f"\n4. preemption at n_slots {preempt_n_slots}: recompute vs swap")
    t = time.perf_counter()
    pre = preemption.preemption_experiment(requests, runner, clock, preempt_n_slots, max_num_seqs=args.max_num_seqs,
                                           block_size=args.block_size)
    pre["run_time_s"] = round(time.perf_counter() - t, 1)
    result["preemption"] = pre
    for mode, m in pre["modes"].items():
        print(f"  {mode:<10} " + fmt(m, METRICS[3:]) + f"  recomputed tokens {m['recomputed_tokens']}  "
              f"blocks swapped out {m['num_blocks_swapped_out']}  E2E p50 {m['e2e_p50_s']:.3f}")
    print(f"  same outputs: {pre['same_outputs']}")

    print("\n5. Triton kernels vs torch references")
    result["kernels"] = kernel_check(device=args.device)
    print("  " + ", ".join(f"{k} {v:.1e}" for k, v in result["kernels"].items() if k.endswith("max_abs_diff")))

    result["run_time_s"] = round(time.perf_counter() - t_start, 1)
    print(f"\ntotal {result['run_time_s']} s")
    result["environment"] = environment(load_before)
    write_json(result, args.json_path)
    return result


def _long_prompt(tokenizer, num_tokens: int) -> list[int]:
    """A chat prompt of about ``num_tokens`` tokens: demo prompts joined until long enough."""
    from minibatch.prompts import chat_prompt_ids

    texts = []
    while len(chat_prompt_ids(tokenizer, "\n\n".join(texts))) < num_tokens:
        texts.append(demo_prompts()[len(texts) % len(demo_prompts())])
    return chat_prompt_ids(tokenizer, "\n\n".join(texts))


def _warm_up(runner, clock) -> None:
    """One tiny request per policy first, so one-time costs do not land on the first measurement."""
    r = Request("warmup", [5, 6, 7, 8], 2, GREEDY)
    for variant in ("orca", "paged", "paged_prefix"):
        policy, options = variant_options(variant, n_slots=64, block_size=4)
        run(policy, [r], runner, clock(), **options)


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
