"""Every benchmark script refuses a bad option before any work: one line on stderr naming the option, exit code 2,
no traceback (``minibatch.checks``: OneLineParser, int_arg, real_arg, ints_arg, reals_arg, output_file_arg,
run_script).

Most cases end with GUARD, an option no script has: were the bad option accepted by mistake, argparse would refuse
GUARD instead (and the test fail at once) rather than the benchmark start. Cases whose check runs after parsing
(options that are only bad together) cannot carry it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUARD = "--no-such-option-guard"
NO_FILE = "README.md/x.json"  # an ancestor is a file: no file can be written there, whoever runs the test

CASES = [
    ("cpu_decode_memory.py", ["--threads", "0", GUARD], "argument --threads: must be an int in [1, 1024], got 0"),
    ("cpu_decode_memory.py", ["--cache-gib", "nan", GUARD], "argument --cache-gib: must be a finite number in (0,"),
    ("cpu_decode_memory.py", ["--cache-gib", "0.001"], "--cache-gib 0.001 holds 2 blocks a layer, fewer than the 512"),
    ("prefill_attention.py", ["--json", NO_FILE, GUARD], "argument --json: "),
    ("decode_step_runs.py", ["--runs", "0", GUARD], "argument --runs: must be an int in [1, 100], got 0"),
    ("decode_step_runs.py", ["--attention-backend", "nope", GUARD], "argument --attention-backend: invalid choice"),
    ("fused_projections.py", ["--attention-backend", "nope", GUARD], "argument --attention-backend: invalid choice"),
    ("chunked_prefill.py", ["--rate", "nan", GUARD], "argument --rate: must be a finite number in [1e-06, 1000000.0]"),
    ("chunked_prefill.py", ["--budgets", "64,,128", GUARD], "argument --budgets: must be a comma-separated list"),
    ("chunked_prefill.py", ["--target-itl-ms", "0", GUARD], "argument --target-itl-ms: must be a finite number in (0,"),
    ("chunked_prefill.py", ["--device", "gpu", GUARD], "argument --device: must be cpu, cuda or cuda:N, got 'gpu'"),
    ("chunked_prefill.py", ["--num-requests", "2", "--long-prompts", "3"],
     "--long-prompts (at most --num-requests) must be an int in [0, 2]"),
    ("first_run.py", ["--json", "benchmarks", GUARD], "argument --json: benchmarks is a folder"),
    ("first_run.py", ["--", "--policis", "paged"], "compare option: unrecognized arguments: --policis paged"),
    ("first_run.py", ["--", "--num-requests", "x"], "compare option: argument --num-requests: "),
    ("first_run.py", ["--", "--json", "out.json"], "--json is set by this script"),
    ("gather_blocks.py", ["--requests", "-1", GUARD], "argument --requests: must be an int in [1, 4096], got -1"),
    ("kv_huge_pages.py", ["--steps", "0", GUARD], "argument --steps: must be an int in [1, 100000], got 0"),
    ("kv_huge_pages.py", ["--requests", "4096", "--context", "8192"], "more than the 2 GiB cache holds"),
    ("keep_freed_memory.py", ["--pairs", "0", GUARD], "argument --pairs: must be an int in [1, 1000], got 0"),
    ("keep_freed_memory.py", ["--policy", "nope", GUARD], "argument --policy: invalid choice: 'nope'"),
    ("paged_kv.py", ["--n-slots", "400,x", GUARD], "argument --n-slots: must be an int in [1, "),
    ("paged_kv.py", ["--seed", str(2**32), GUARD], "argument --seed: must be an int in [0, 4294967295]"),
    ("long_prompt_stall.py", ["--configs", "chunked:sdpa,paged", GUARD], "argument --configs: must be comma-separated "
     "POLICY:BACKEND pairs"),
    ("long_prompt_stall.py", ["--prompt-len", "0", GUARD], "argument --prompt-len: must be an int in [1, 100000]"),
    ("serving.py", ["--rates", "1,1e-7", GUARD], "argument --rates: must be a finite number in [1e-06, 1000000.0]"),
    ("serving.py", ["--policies", "chunked,nope", GUARD], "argument --policies: policy must be one of"),
    ("serving.py", ["--slo-ttft-s", "0", GUARD], "argument --slo-ttft-s: must be a finite number in (0,"),
    ("sim_scale.py", ["--num-requests", "0", GUARD], "argument --num-requests: must be an int in [1, 1000000]"),
    ("sim_scale.py", ["--settings", "cpu,gpu"], "--settings must be a comma-separated subset of cpu,h100-roofline"),
    ("spec_decode.py", ["--ks", "0,2", GUARD], "argument --ks: must be an int in [1, 64], got 0"),
    ("detokenize.py", ["--lengths", "0", GUARD], "argument --lengths: must be an int in [1, "),
    ("hostile_bodies.py", ["--bodies", "0", GUARD], "argument --bodies: must be an int in [1, 64], got 0"),
    ("hostile_bodies.py", ["--json", NO_FILE, GUARD], "argument --json: "),
    # --quick sets these itself: given too, they were silently replaced (were the check missing, a tiny smoke test)
    ("spec_decode.py", ["--model", "tiny-random-llama", "--quick", "--ks", "2"], "--ks does not apply with --quick"),
    ("chunked_prefill.py", ["--model", "tiny-random-llama", "--quick", "--num-requests", "5"],
     "--num-requests does not apply with --quick"),
    ("spec_decode.py", ["--json", NO_FILE, GUARD], "argument --json: "),
    ("third_party_clients.py", ["--rates", "-1", GUARD], "argument --rates: must be a finite number in [1e-06,"),
    ("third_party_clients.py", ["--threads", "2000", GUARD], "argument --threads: must be an int in [1, 1024]"),
]


@pytest.mark.parametrize("script, argv, message", CASES, ids=[f"{s}:{a[0]}={a[1]}" for s, a, _ in CASES])
def test_a_bad_option_is_refused_in_one_line(script, argv, message):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *argv], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(f"{script}: error: "), proc.stderr
    assert message in proc.stderr, proc.stderr
