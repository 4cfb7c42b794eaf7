"""The AVX512-BF16 linear (``minibatch/kernels/cpu_bf16_linear.cpp``) against oneDNN's matmul on the same prepacked
weights (``minibatch/runner/prepack.py``), on SmolLM2-135M in bf16 on a CPU with AVX512-BF16 and no AMX: two copies of
the model, both prepacked with q/k/v and gate/up grouped, one with the kernel turned off (every product on oneDNN):

* ``linears``: every linear layer of the model called once on ``rows`` random rows, in the model's order, inside the
  engine's steps' context (``engine_linears``: the only place the kernel runs);
* ``engine``: whole decode steps of B requests with 256 cached tokens each, on two ModelRunners (fused decode
  layers, ``cpp`` attention) that differ only in that, steps alternating between them; medians;
* ``call_overhead_us``: one call of each on a 64 x 64 weight and 32 rows (what a call costs before its work).

    python benchmarks/bf16_linear.py --batches 1,8,32,64 --json data/cpu/bf16_linear.json

Up to ``BF16_MAX_ROWS`` (64) rows the engine runs the kernel; the same code as ``amx_linear.py``.
"""

from __future__ import annotations

from amx_linear import main as run

if __name__ == "__main__":
    from minibatch.checks import run_script

    run_script(lambda: run(kernel="bf16", doc=__doc__))  # an error in one line, not a traceback
