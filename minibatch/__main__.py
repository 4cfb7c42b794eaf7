"""Command line: ``python -m minibatch compare [options]`` (see ``--help``)."""

from __future__ import annotations

import argparse
import sys

from minibatch.compare import ALL_POLICIES, CompareConfig, run_compare


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minibatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="run one trace through static, orca, paged, chunked prefill and the Hugging Face baselines")
    d = CompareConfig()
    c.add_argument("--model", default=d.model,
                   help="smollm2-135m (offline default), tiny-random-llama, tiny-random-gpt2, a local dir or a hub id")
    c.add_argument("--num-requests", type=int, default=d.num_requests, help="requests in the generated trace")
    c.add_argument("--rate", type=float, default=d.rate, help="arrival rate, requests/s")
    c.add_argument("--arrival", default=d.arrival, choices=["poisson", "zero", "gamma"], help="arrival process")
    c.add_argument("--trace", default=None, help="a trace JSON (minibatch.workload.save_trace) instead of a generated one")
    c.add_argument("--policies", default=",".join(d.policies), help=f"comma-separated subset of {','.join(ALL_POLICIES)}")
    c.add_argument("--clock", default=d.clock, choices=["wall", "sim"],
                   help="wall: measured; sim: cost-model step times (HF baselines are always wall)")
    c.add_argument("--seed", type=int, default=d.seed)
    c.add_argument("--batch-size", type=int, default=d.batch_size, help="requests per batch for static and hf_generate")
    c.add_argument("--max-bs", type=int, default=d.max_bs, help="orca: most requests per iteration (KV memory limits it too)")
    c.add_argument("--max-wait-s", type=float, default=d.max_wait_s, help="static batching: longest wait for a full batch")
    c.add_argument("--max-prompt-len", type=int, default=d.max_prompt_len, help="clip ShareGPT prompt lengths (tokens)")
    c.add_argument("--max-output-len", type=int, default=d.max_output_len, help="clip ShareGPT output lengths (tokens)")
    c.add_argument("--output-scale", type=float, default=d.output_scale,
                   help="multiply ShareGPT output lengths by this before clipping (keeps their spread)")
    c.add_argument("--n-slots", type=int, default=None, help="KV token slots (default: batch-size x longest request, the memory a padded static batch needs)")
    c.add_argument("--block-size", type=int, default=d.block_size, help="paged policies: KV block size in tokens")
    c.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap"],
                   help="paged policies: what happens to a request preempted when KV blocks run out")
    c.add_argument("--orca-reservation", default=d.orca_reservation, choices=["oracle", "max"],
                   help="orca: reserve prompt + the trace's output length (oracle, its best case) or "
                        "prompt + --max-output-len (max: a server that cannot know when EOS comes)")
    c.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="chunked policies: token budget per step (default 512; the other policies have no budget)")
    c.add_argument("--target-itl-ms", type=float, default=None,
                   help="chunked: adaptive chunk size, choosing each step's budget to aim at this step time (ms)")
    c.add_argument("--policy-order", default=d.policy_order, choices=["fcfs", "sjf", "priority"],
                   help="queue policy of every iteration-level scheduler")
    c.add_argument("--aging-s", type=float, default=d.aging_s,
                   help="priority order: seconds of waiting worth one priority level")
    c.add_argument("--long-prompts", type=int, default=d.long_prompts,
                   help="the long-prompt trace: this many requests (spread over the trace) get --long-prompt-len tokens")
    c.add_argument("--long-prompt-len", type=int, default=d.long_prompt_len, help="tokens in each long prompt")
    c.add_argument("--draft-model", default=None,
                   help="spec: the draft model (default: smollm2-135m-draft for smollm2-135m, else the target itself)")
    c.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="spec policies: draft tokens per step, k (with --adaptive-k: the largest k)")
    c.add_argument("--adaptive-k", action="store_true", help="spec policies: choose k per request from its acceptance rate")
    c.add_argument("--attention-backend", default=d.attention_backend, choices=["torch", "triton"],
                   help="our packed attention: torch reference or Triton kernels (interpreted, slow, on CPU)")
    c.add_argument("--slo-ttft-s", type=float, default=d.slo_ttft_s, help="goodput: TTFT objective, seconds")
    c.add_argument("--slo-tpot-s", type=float, default=d.slo_tpot_s, help="goodput: TPOT objective, seconds")
    c.add_argument("--no-reference", action="store_true", help="skip the per-request HF generate check")
    c.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    c.add_argument("--figures-dir", default=d.figures_dir, help="where PNG figures go ('' = none)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "compare":
        try:
            cfg = CompareConfig(
                model=args.model, num_requests=args.num_requests, rate=args.rate, arrival=args.arrival,
                trace=args.trace, policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
                clock=args.clock, seed=args.seed, batch_size=args.batch_size, max_bs=args.max_bs, max_wait_s=args.max_wait_s,
                max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len,
                output_scale=args.output_scale, n_slots=args.n_slots, block_size=args.block_size,
                preemption_mode=args.preemption_mode, attention_backend=args.attention_backend,
                orca_reservation=args.orca_reservation, max_num_batched_tokens=args.max_num_batched_tokens,
                target_itl_ms=args.target_itl_ms, policy_order=args.policy_order, aging_s=args.aging_s,
                long_prompts=args.long_prompts, long_prompt_len=args.long_prompt_len,
                draft_model=args.draft_model, num_speculative_tokens=args.num_speculative_tokens,
                adaptive_k=args.adaptive_k,
                slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_s,
                check_reference=not args.no_reference, json_path=args.json_path,
                figures_dir=args.figures_dir or None, progress=not args.no_progress,
                command=" ".join(["python -m minibatch"] + (argv if argv is not None else sys.argv[1:])),
            )
        except ValueError as e:
            parser.error(str(e))
        run_compare(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
