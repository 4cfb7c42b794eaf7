"""Command line (see ``--help`` of each):

    python -m minibatch compare     one trace through every policy on the real model (the main job)
    python -m minibatch calibrate   measure step times on this machine, fit the simulator's cost model
    python -m minibatch simulate    a trace through our schedulers with no model, on a calibrated clock
"""

from __future__ import annotations

import argparse
import sys

from minibatch.compare import ALL_POLICIES, CompareConfig, run_compare
from minibatch.policies import ENGINE_POLICIES

SIM_DEFAULT_POLICIES = ("static", "orca", "paged", "prefill_first", "chunked")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``minibatch compare: error: --n-slots must be ...`` on
    stderr and exit code 2, no usage block and never a traceback."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def add_run_args(p: argparse.ArgumentParser, d: CompareConfig, model: bool = True) -> None:
    """The trace, policy and output options compare and simulate share; model: add compare's
    model-only options too (--model, --clock, --draft-model, ...)."""
    if model:
        p.add_argument("--model", default=d.model,
                       help="smollm2-135m (offline default), tiny-random-llama, tiny-random-gpt2, a local dir or a hub id")
    p.add_argument("--num-requests", type=int, default=d.num_requests, help="requests in the generated trace")
    p.add_argument("--rate", type=float, default=d.rate, help="arrival rate, requests/s")
    p.add_argument("--arrival", default=d.arrival, choices=["poisson", "zero", "gamma"], help="arrival process")
    p.add_argument("--trace", default=None, help="a trace JSON (minibatch.workload.save_trace) instead of a generated one")
    p.add_argument("--policies", default=",".join(d.policies if model else SIM_DEFAULT_POLICIES),
                   help=f"comma-separated subset of {','.join(ALL_POLICIES if model else ENGINE_POLICIES)}")
    if model:
        p.add_argument("--clock", default=d.clock, choices=["wall", "sim"],
                       help="wall: measured; sim: cost-model step times (HF baselines are always wall)")
        p.add_argument("--device", default=d.device, help="where the model runs: cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="requests per batch for static and hf_generate")
    p.add_argument("--max-bs", type=int, default=d.max_bs, help="orca: most requests per iteration (KV memory limits it too)")
    p.add_argument("--max-wait-s", type=float, default=d.max_wait_s, help="static batching: longest wait for a full batch")
    p.add_argument("--max-prompt-len", type=int, default=d.max_prompt_len, help="clip ShareGPT prompt lengths (tokens)")
    p.add_argument("--max-output-len", type=int, default=d.max_output_len, help="clip ShareGPT output lengths (tokens)")
    p.add_argument("--output-scale", type=float, default=d.output_scale,
                   help="multiply ShareGPT output lengths by this before clipping (keeps their spread)")
    p.add_argument("--n-slots", type=int, default=None, help="KV token slots (default: batch-size x longest request, the memory a padded static batch needs)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="paged policies: KV block size in tokens")
    p.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap"],
                   help="paged policies: what happens to a request preempted when KV blocks run out")
    p.add_argument("--orca-reservation", default=d.orca_reservation, choices=["oracle", "max"],
                   help="orca: reserve prompt + the trace's output length (oracle, its best case) or "
                        "prompt + --max-output-len (max: a server that cannot know when EOS comes)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="chunked policies: token budget per step (default 512; the other policies have no budget)")
    p.add_argument("--target-itl-ms", type=float, default=None,
                   help="chunked: adaptive chunk size, choosing each step's budget to aim at this step time (ms)")
    p.add_argument("--policy-order", default=d.policy_order, choices=["fcfs", "sjf", "priority"],
                   help="queue policy of every iteration-level scheduler")
    p.add_argument("--aging-s", type=float, default=d.aging_s,
                   help="priority order: seconds of waiting worth one priority level")
    p.add_argument("--long-prompts", type=int, default=d.long_prompts,
                   help="the long-prompt trace: this many requests (spread over the trace) get --long-prompt-len tokens")
    p.add_argument("--long-prompt-len", type=int, default=d.long_prompt_len, help="tokens in each long prompt")
    if model:
        p.add_argument("--draft-model", default=None,
                       help="spec: the draft model (default: smollm2-135m-draft for smollm2-135m, else the target itself)")
    p.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="spec policies: draft tokens per step, k (with --adaptive-k: the largest k)")
    p.add_argument("--adaptive-k", action="store_true", help="spec policies: choose k per request from its acceptance rate")
    if model:
        p.add_argument("--attention-backend", default=d.attention_backend, choices=["torch", "triton"],
                       help="our packed attention: torch reference or Triton kernels (interpreted, slow, on CPU)")
    p.add_argument("--slo-ttft-s", type=float, default=d.slo_ttft_s, help="goodput: TTFT objective, seconds")
    p.add_argument("--slo-tpot-s", type=float, default=d.slo_tpot_s, help="goodput: TPOT objective, seconds")
    if model:
        p.add_argument("--no-reference", action="store_true", help="skip the per-request HF generate check")
    p.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    if model:
        p.add_argument("--figures-dir", default=d.figures_dir, help="where PNG figures go ('' = none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--trace-out", default=None,
                   help="write each policy's schedule as a Chrome trace JSON (Perfetto, chrome://tracing) into this folder")
    p.add_argument("--profile", default=d.profile, required=not model,
                   help="a calibrated cost model (python -m minibatch calibrate)" + ("" if not model else " for --clock sim"))


def parse_acceptance_rate(text: str | None) -> float | list[float] | None:
    """"0.7" -> 0.7; "0.6,0.3,0.1" -> per-position rates; None -> None.

    Raises:
        ValueError: not numbers in [0, 1], or per-position rates that increase (names --acceptance-rate).
    """
    if text is None:
        return None
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--acceptance-rate must be a number or comma-separated numbers in [0, 1], got {text!r}") from None
    if not all(0.0 <= a <= 1.0 for a in rates):
        raise ValueError(f"--acceptance-rate must be in [0, 1], got {text!r}")
    if any(b > a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"--acceptance-rate per-position rates must be non-increasing (position i+1 is "
                         f"reached only through position i), got {text!r}")
    return rates[0] if len(rates) == 1 else rates


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minibatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="run one trace through static, orca, paged, chunked prefill and the Hugging Face baselines")
    d = CompareConfig()
    add_run_args(c, d)
    s = sub.add_parser("simulate", help="run a trace through our schedulers with no model, on a calibrated clock")
    add_run_args(s, d, model=False)
    s.add_argument("--acceptance-rate", default=None,
                   help="spec policies: acceptance rate, or comma-separated per-position rates")
    k = sub.add_parser("calibrate", help="measure step times of a model on this machine and fit the simulator's cost model")
    k.add_argument("--model", default=d.model, help="as in compare")
    k.add_argument("--device", default="cpu", help="cpu or cuda")
    k.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    k.add_argument("--draft-model", default=None, help="also calibrate this draft model (spec policies in simulation)")
    k.add_argument("--scale", type=float, default=1.0, help="shrink the calibration workloads, in (0, 1]")
    k.add_argument("--out", default=None, help="profile JSON (default data/profiles/<model>-<device>.json)")
    k.add_argument("--draft-only", default=None, metavar="PROFILE",
                   help="measure only --draft-model and add it to this profile (writes --out or PROFILE)")
    k.add_argument("--refit", default=None, metavar="PROFILE",
                   help="no measuring: fit this profile's stored samples again with the current code (writes --out or PROFILE)")
    k.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line. Returns 0 when done; otherwise raises SystemExit (as argparse does) with
    code 2 for a bad option or input (one line on stderr naming it, checked before any model
    loads where it can be), 1 for a failed file write, 130 when interrupted (Ctrl-C: one line,
    and no partial output file: every write is atomic)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = f"{parser.prog} {args.command}"
    try:
        return _run(parser, args, argv)
    except KeyboardInterrupt:
        print(f"{sub}: interrupted", file=sys.stderr)
        code = 130
    except (ValueError, TypeError, NotImplementedError, FileNotFoundError, IsADirectoryError) as e:
        print(f"{sub}: error: {' '.join(str(e).split())}", file=sys.stderr)
        code = 2
    except OSError as e:  # a write failed (disk full, permissions), a model could not be fetched
        print(f"{sub}: error: {' '.join(str(e).split())}", file=sys.stderr)
        code = 1
    except MemoryError:
        print(f"{sub}: error: out of memory (use fewer requests, shorter lengths or fewer KV slots)", file=sys.stderr)
        code = 1
    raise SystemExit(code)


def _run(parser: argparse.ArgumentParser, args, argv: list[str] | None) -> int:
    from minibatch.checks import check_device, check_int, check_real
    from minibatch.files import check_output_file

    command = " ".join(["python -m minibatch"] + (argv if argv is not None else sys.argv[1:]))
    if args.command in ("compare", "simulate"):
        model = args.command == "compare"
        cfg = CompareConfig(
            num_requests=args.num_requests, rate=args.rate, arrival=args.arrival,
            trace=args.trace, policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
            seed=args.seed, batch_size=args.batch_size, max_bs=args.max_bs, max_wait_s=args.max_wait_s,
            max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len,
            output_scale=args.output_scale, n_slots=args.n_slots, block_size=args.block_size,
            preemption_mode=args.preemption_mode,
            orca_reservation=args.orca_reservation, max_num_batched_tokens=args.max_num_batched_tokens,
            target_itl_ms=args.target_itl_ms, policy_order=args.policy_order, aging_s=args.aging_s,
            long_prompts=args.long_prompts, long_prompt_len=args.long_prompt_len,
            num_speculative_tokens=args.num_speculative_tokens, adaptive_k=args.adaptive_k,
            slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_s, json_path=args.json_path,
            progress=not args.no_progress, profile=args.profile, trace_out=args.trace_out, command=command,
            **(dict(model=args.model, clock=args.clock, device=args.device, attention_backend=args.attention_backend,
                    draft_model=args.draft_model, check_reference=not args.no_reference,
                    figures_dir=args.figures_dir or None) if model else
               dict(clock="sim", check_reference=False, figures_dir=None)),
        )
        if model:
            run_compare(cfg)
        else:
            from minibatch.sim.cost_model import Profile
            from minibatch.sim.simulator import run_simulation

            acceptance = parse_acceptance_rate(args.acceptance_rate)
            Profile.load(args.profile)  # a bad profile is reported before the run
            run_simulation(cfg, args.profile, acceptance)
        return 0
    # calibrate
    from minibatch.models import check_model_name
    from minibatch.sim.calibrate import calibrate, print_profile, refit
    from minibatch.sim.cost_model import Profile

    check_device(args.device, "--device")
    if args.threads is not None:
        check_int(args.threads, "--threads", 1, 1024)
    check_real(args.scale, "--scale", 0.0, 1.0, low_open=True)
    if args.out is not None:
        check_output_file(args.out, "--out")
    if args.draft_only:
        from minibatch.sim.calibrate import calibrate_draft

        if not args.draft_model:
            raise ValueError("--draft-only needs --draft-model")
        check_model_name(args.draft_model, "--draft-model")
        base = Profile.load(args.draft_only)
        check_output_file(args.out or args.draft_only, "--out")
        profile = calibrate_draft(base, args.draft_model, args.device, args.threads, args.scale,
                                  progress=not args.no_progress)
        profile.meta["draft_command"] = command
        print_profile(profile)
        print(f"wrote {profile.save(args.out or args.draft_only)} (draft {args.draft_model} added)")
        return 0
    if args.refit:
        base = Profile.load(args.refit)
        check_output_file(args.out or args.refit, "--out")
        profile = refit(base)
        print_profile(profile)
        print(f"wrote {profile.save(args.out or args.refit)} (refit of {args.refit})")
        return 0
    check_model_name(args.model, "--model")
    if args.draft_model:
        check_model_name(args.draft_model, "--draft-model")
    out = args.out or f"data/profiles/{args.model.replace('/', '_')}-{args.device}.json"
    check_output_file(out, "--out")
    profile = calibrate(args.model, args.device, args.threads, args.scale, args.draft_model,
                        progress=not args.no_progress, command=command)
    print_profile(profile)
    print(f"wrote {profile.save(out)} ({profile.meta['calibration_time_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
