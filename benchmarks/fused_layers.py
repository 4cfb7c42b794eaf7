"""Fused decode layers (``minibatch/runner/fused_layers.py``, ``minibatch/kernels/cpu_decode_layer.cpp``: one C++
call per decoder layer in an all-decode step) against the model's own forward (the same packed linears, or in bf16
the same oneDNN products, and ``cpp`` attention kernel, called module by module), on SmolLM2-135M: whole decode
steps of B requests with 256 cached tokens each, two ModelRunners on one model that differ only in
``fuse_decode_layers``, steps alternating between them; medians.

    python benchmarks/fused_layers.py --json data/cpu/fused_layers.json
    python benchmarks/fused_layers.py --dtype bfloat16 --json data/cpu/fused_layers_bfloat16.json

``--against-rev REV`` adds a third way, "fused_REV": the fused layers with the kernel built from the C++ sources at
git revision REV (an A/B of a kernel change in one process; the Python side is today's for both).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

from fused_projections import parser, step_times


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # git runs here, and build/ is made here


def commit_arg(rev: str) -> str:
    """An argparse ``type`` for ``--against-rev``: ``rev`` if it names a commit of this repository."""
    if subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=REPO,
                      capture_output=True).returncode != 0:
        raise argparse.ArgumentTypeError(f"{rev!r} is not a commit of this repository")
    return rev


def kernel_sources_at(rev: str, name: str) -> str:
    """A folder build/<name>_<rev>/ holding minibatch/kernels/'s C++ sources and headers as they were at git revision
    ``rev`` (a file that did not exist then is left empty), to build that revision's kernels beside today's."""
    from minibatch.kernels import cpu_decode_layer

    here = os.path.dirname(cpu_decode_layer.SOURCE)
    folder = os.path.join(REPO, "build", f"{name}_{commit_arg(rev)}")
    os.makedirs(folder, exist_ok=True)
    for file in [f for f in os.listdir(here) if f.endswith((".cpp", ".h"))]:
        shown = subprocess.run(["git", "show", f"{rev}:minibatch/kernels/{file}"], capture_output=True, cwd=REPO)
        with open(os.path.join(folder, file), "wb") as f:
            f.write(shown.stdout if shown.returncode == 0 else b"")
    return folder


def kernel_at(rev: str):
    """The fused layer's extension built from the kernel sources (every file of minibatch/kernels/ the build reads)
    at git revision ``rev``, in build/fused_<rev>/."""
    from minibatch.kernels import cpp_build, cpu_decode_layer

    folder = kernel_sources_at(rev, "fused")
    layer = cpu_decode_layer.KERNEL
    return cpp_build.build(os.path.join(folder, os.path.basename(layer.source)),
                           layer.extra_cflags, tuple(os.path.join(folder, os.path.basename(x))
                                                     for x in layer.extra_sources))


def check_interface(module, rev: str, names: tuple[str, ...]) -> None:
    """Refuse ``module`` (the kernel at ``rev``) when one of today's kernel functions ``names`` is missing from it or
    takes other arguments (pybind11's signature line): today's Python calls it, so the run would end in a TypeError."""
    from minibatch.kernels import cpu_decode_layer

    today = cpu_decode_layer.KERNEL.load()
    for name in names:
        if (getattr(getattr(module, name, None), "__doc__", None) or "").split("\n")[:1] != \
                (getattr(today, name).__doc__ or "").split("\n")[:1]:
            raise ValueError(f"--against-rev {rev}: its kernel's {name} takes other arguments than this tree's fused "
                             "layers pass (the kernel's interface changed after it); compare against a later revision")


def with_kernel(runner, module):
    """``runner``'s packed forward calls ``module``'s fused layer (swapped in around each call)."""
    from minibatch.kernels import cpu_decode_layer

    forward = runner.forward_packed

    def swapped(*args, **kwargs):
        today, cpu_decode_layer.KERNEL.module = cpu_decode_layer.KERNEL.load(), module
        try:
            return forward(*args, **kwargs)
        finally:
            cpu_decode_layer.KERNEL.module = today

    runner.forward_packed = swapped


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.set_defaults(batches="1,8,32,64")
    p.add_argument("--against-rev", type=commit_arg, default=None,
                   help="also time the fused layers with the kernel at this git rev")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the model's dtype (bfloat16: decode_layer_prepacked on oneDNN's prepacked products)")
    args = p.parse_args(argv)
    from minibatch.models import load_model
    from minibatch.report import environment, machine_load, write_json
    from minibatch.runner import ModelRunner

    torch.set_num_threads(args.threads)
    load_before = machine_load()
    model, tokenizer = load_model("smollm2-135m", dtype=args.dtype)
    runners = {name: ModelRunner(model, tokenizer, attention_backend="cpp", fuse_decode_layers=fuse)
               for name, fuse in (("modules", False), ("fused", True))}
    if runners["fused"].fused_decoder is None:
        sys.exit("fused decode layers are not available here (no C++ compiler to build them)")
    if args.against_rev:
        runners[f"fused_{args.against_rev}"] = ModelRunner(model, tokenizer, attention_backend="cpp")
        layer = "decode_layer_prepacked" if args.dtype == "bfloat16" else "decode_layer"  # what the steps call
        check_interface(kernel := kernel_at(args.against_rev), args.against_rev, (layer,))
        with_kernel(runners[f"fused_{args.against_rev}"], kernel)
    rows = []
    for n in args.batches:
        steps = step_times(runners, n, args.steps)
        rows.append({"batch": n, "decode_step_ms": steps, "step_speedup": round(steps["modules"] / steps["fused"], 2)}
                    | ({"speedup_over_rev": round(steps[f"fused_{args.against_rev}"] / steps["fused"], 2)}
                       if args.against_rev else {}))
        print(rows[-1])
    result = {"command": "python benchmarks/fused_layers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": environment(load_before), "model": "smollm2-135m", "dtype": args.dtype,
              "attention_backend": "cpp", "threads": args.threads, "rows": rows}
    write_json(result, args.json_path)
    return result


if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(main)  # an error in one line, not a traceback
