"""Speculative decoding measured on a real model: notebook 06's experiments on the wall clock.

    python benchmarks/spec_decode.py --json data/cpu/spec_decode.json          (smollm2-135m + its draft)
    python benchmarks/spec_decode.py --model tiny-random-llama --quick           (a smoke test, seconds)

1. k sweep at batch 1: --num-prompts held-out ShareGPT prompts (``minibatch.sharegpt.select_prompts``:
   the draft never trained on them), greedy, up to --max-new-tokens each, run one at a time
   (max_num_seqs 1) with no speculation, the draft at each --ks, AdaptiveK and n-gram lookup. Reports
   output and decode throughput, TPOT, acceptance rate, mean acceptance length, per-position
   acceptance, draft / verify time; checks every run produced the same tokens.
2. batch sweep: the same prompts with --batch-sizes requests decoding together, no speculation vs
   the draft at --batch-k: the speedup shrinks as the batch grows.
3. input-grounded prompts (a summary, a code fix, an edit: the answer copies from the prompt):
   n-gram lookup vs the draft vs none.

At the end the batch-1 decode speedups are printed beside the papers' (Leviathan et al. 2-3x, Chen et al.
2-2.5x, both at batch 1 on accelerators). Warm-up runs come first so no run pays first-call costs.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from minibatch.checks import (MAX_NUM_REQUESTS, MAX_NUM_SEQS, MAX_SPEC_TOKENS, MAX_TOKENS, OneLineParser,
                              check_not_given, int_arg, ints_arg, output_file_arg)
from minibatch.experiment import default_draft, load_draft_runner
from minibatch.report import environment, machine_load, write_json
from minibatch.lessons import speculative as lesson
from minibatch.experiments.speculative import GROUNDED_PROMPTS, k_sweep
from minibatch.request import Request, SamplingParams
from minibatch.clock import WallClock

def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default=None, help="draft model (default: smollm2-135m-draft, or the model itself)")
    p.add_argument("--num-prompts", type=int_arg(1, MAX_NUM_REQUESTS), default=12)
    p.add_argument("--max-new-tokens", type=int_arg(1, MAX_TOKENS), default=128)
    p.add_argument("--ks", type=ints_arg(1, MAX_SPEC_TOKENS), default="1,2,3,4,5,6")
    p.add_argument("--batch-sizes", type=ints_arg(1, MAX_NUM_SEQS), default="1,4,12")
    p.add_argument("--batch-k", type=int_arg(1, MAX_SPEC_TOKENS), default=3)
    p.add_argument("--threads", type=int_arg(1, 1024), default=None)
    p.add_argument("--json", dest="json_path", type=output_file_arg, default=None)
    p.add_argument("--quick", action="store_true", help="smoke test: few prompts, few tokens")
    args = p.parse_args(argv)
    if args.quick:
        check_not_given(p, args, ("num_prompts", "max_new_tokens", "ks", "batch_sizes"), "with --quick, which sets it")
    args.command = " ".join(["python benchmarks/spec_decode.py"] + (argv if argv is not None else sys.argv[1:]))
    return args


def prompts(tokenizer, model: str, n: int) -> list[list[int]]:
    if model == "smollm2-135m":
        from minibatch.sharegpt import select_prompts

        return [ids for _, ids in select_prompts(tokenizer, num_eval=n, num_train=0)[0]]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (16,), generator=g).tolist() for _ in range(n)]


def main(argv=None) -> dict:
    from minibatch.models import load_model
    from minibatch.runner import ModelRunner
    from minibatch.prompts import chat_prompt_ids

    args = parse_args(argv)
    load_before = machine_load()  # how busy the machine was: recorded with the result
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.ks, args.batch_sizes = 3, 16, (2, 4), (1, 3)
    model, tok = load_model(args.model)
    draft_name = args.draft or default_draft(args.model)
    target_runner, draft_runner = ModelRunner(model, tok), load_draft_runner(draft_name, args.model, model, tok)
    draft = draft_runner.model
    greedy = SamplingParams()
    reqs = [Request(f"p{i}", ids, args.max_new_tokens, greedy)
            for i, ids in enumerate(prompts(tok, args.model, args.num_prompts))]
    ks = list(args.ks)
    result = {"command": args.command, "environment": environment(), "model": args.model, "draft": draft_name,
              "draft_parameters": sum(p.numel() for p in draft.parameters()), "clock": "wall",
              "num_prompts": len(reqs), "max_new_tokens": args.max_new_tokens}

    warm = [r.copy() for r in reqs[:1]]
    for w in warm:
        w.max_new_tokens = 8
    k_sweep(warm, target_runner, draft_runner, WallClock, ks=(2,), adaptive_max_k=None)  # warm-up
    from minibatch.spec import forward_time_s, measure_verify_cost

    v = measure_verify_cost(target_runner, k=4)
    c = forward_time_s(draft_runner) / forward_time_s(target_runner)
    result["verify_cost_ratio"], result["draft_cost_ratio"] = v, c
    print(f"a verify forward (5 tokens) costs {v:.2f} decodes; a draft forward {c:.3f} of a target decode")
    t0 = time.perf_counter()
    rows, same = k_sweep(reqs, target_runner, draft_runner, WallClock, ks=ks, adaptive_max_k=max(ks),
                                verify_cost_ratio=v)
    print(f"\n1. batch 1, {len(reqs)} held-out prompts ({time.perf_counter() - t0:.0f} s); "
          f"same tokens in every run: {same}")
    lesson.print_rows(rows)
    best = max((r for r in rows if r["run"].startswith("draft k=")), key=lambda r: r["decode_speedup"])
    result["batch1"] = {"rows": rows, "same_outputs": same, "best_fixed_k": best["run"],
                        "best_decode_speedup": best["decode_speedup"], "best_speedup": best["speedup"]}

    batch_rows = []
    for B in args.batch_sizes:
        (base, spec), same = k_sweep(reqs, target_runner, draft_runner, WallClock, ks=(args.batch_k,),
                                            max_num_seqs=B, adaptive_max_k=None, ngram=False)
        batch_rows.append({"batch_size": B, "k": args.batch_k, "plain": base, "spec": spec,
                           "speedup": spec["speedup"], "same_outputs": same})
        print(f"2. batch {B}: no speculation {base['output_throughput_tok_s']:.1f} tok/s, draft k={args.batch_k} "
              f"{spec['output_throughput_tok_s']:.1f} tok/s -> {spec['speedup']:.2f}x (same tokens: {same})")
    result["batch_sweep"] = batch_rows

    if args.model == "smollm2-135m":
        grounded = [Request(f"g{i}", chat_prompt_ids(tok, t), args.max_new_tokens, greedy)
                    for i, t in enumerate(GROUNDED_PROMPTS)]
        g_rows, g_same = k_sweep(grounded, target_runner, draft_runner, WallClock, ks=(3,), adaptive_max_k=None)
        print(f"\n3. input-grounded prompts; same tokens: {g_same}")
        lesson.print_rows(g_rows)
        result["grounded"] = {"prompts": list(GROUNDED_PROMPTS), "rows": g_rows, "same_outputs": g_same}

    print()
    lesson.print_against_papers(result)
    result["environment"] = environment(load_before)
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
