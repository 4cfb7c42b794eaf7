"""Notebook 04 (paged KV cache): printers, the two prediction checks, and the names the notebook,
``benchmarks/paged_kv.py`` and the tests import from here.

vLLM (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP'23) stores the KV cache in fixed-size blocks handed out on demand (§4.1,
§4.2), shares blocks between requests by reference counting (§4.4: parallel sampling with
copy-on-write, shared prefixes), and preempts by recompute or swap when blocks run out (§4.5).
The engine pieces are ``minibatch/kv/block_manager.py`` and ``minibatch/scheduler/paged.py``.
The measurements live in ``minibatch.experiments`` (``paged_kv``: the lesson's variants and a run's
numbers; ``kv_waste``: Orca's reservation vs paged blocks; ``kv_sharing``: prefix caching and
copy-on-write; ``preemption``: recompute vs swap; ``kernel_check``: the Triton kernels vs their torch
references), the figures in ``minibatch.viz.paged_kv``.
"""

from __future__ import annotations

from minibatch.engine import StepRecord
from minibatch.lessons import exercise
from minibatch.viz.paged_kv import VLLM_CLAIM


# ---------------------------------------------------------------------- tables
TABLE_COLUMNS = (("kv_waste_fraction", "KV waste", "{:.1%}"), ("kv_usage_fraction", "KV used", "{:.1%}"),
                 ("max_num_running", "max run", "{}"), ("mean_batch_size", "mean batch", "{:.1f}"),
                 ("output_throughput_tok_s", "out tok/s", "{:.1f}"), ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
                 ("ttft_p99_s", "TTFT p99 s", "{:.3f}"), ("num_preemptions", "preempted", "{}"))


def print_policy_table(rows: list[dict]) -> None:
    """One line per (n_slots, policy) of :func:`reservation_vs_paged` results: KV waste (of
    reserved slots), KV used (of n_slots, mean over steps), concurrency, throughput, TTFT."""
    print(f"{'n_slots':>7}  {'policy':<13}" + "".join(f"{label:>11}" for _, label, _ in TABLE_COLUMNS))
    for row in rows:
        for name, m in row["policies"].items():
            cells = ("  skipped: " + m["skipped"][:60] if "skipped" in m else
                     "".join(f"{fmt.format(m[key]):>11}" for key, _, fmt in TABLE_COLUMNS))
            print(f"{row['n_slots']:>7}  {name:<13}{cells}")


def print_concurrency(rows: list[dict], claim: dict = VLLM_CLAIM) -> None:
    """Per n_slots of :func:`waste_sweep` results, what the waste changes: the most requests running at once,
    TTFT p50 (s) and output tokens/s of each policy, and paged's preemptions; then the vLLM paper's figures
    (KV holding token states, and so wasted, in the existing systems and in vLLM)."""
    for row in rows:
        ran = {name: m for name, m in row["policies"].items() if "skipped" not in m}
        running = ", ".join(f"{n} {m['max_num_running']}" for n, m in ran.items())
        print(f"{row['n_slots']:>5} slots: most running {running}"
              + "; TTFT p50 " + ", ".join(f"{n} {m['ttft_p50_s']:.2f} s" for n, m in ran.items())
              + "; out tok/s " + ", ".join(f"{n} {m['output_throughput_tok_s']:.0f}" for n, m in ran.items())
              + (f"; paged preempted {ran['paged']['num_preemptions']} times" if "paged" in ran else ""))
    (lo, hi), vllm = claim["existing_systems_waste"], claim["vllm_waste"]
    print(f"vLLM paper: KV holding token states {1 - hi:.1%}-{1 - lo:.1%} in existing systems ({lo:.1%}-{hi:.1%} "
          f"wasted), {1 - vllm:.1%} in vLLM ({vllm:.1%} wasted)")


def print_prefix_table(result: dict) -> None:
    """Per request of :func:`prefix_caching_experiment`: prompt length, prefill tokens and TTFT
    without and with prefix caching; then the totals and hit rates."""
    print(f"{'request':<8}{'prompt':>7}{'prefill':>9}{'prefill (cache)':>17}{'TTFT s':>9}{'TTFT s (cache)':>16}")
    for r in result["requests"]:
        print(f"{r['request_id']:<8}{r['num_prompt_tokens']:>7}{r['prefill_tokens']:>9}{r['prefill_tokens_prefix']:>17}"
              f"{r['ttft_s']:>9.3f}{r['ttft_prefix_s']:>16.3f}")
    for name, m in result["policies"].items():
        print(f"{name:<13} prefill tokens {m['num_prefill_tokens']:>5}, hit rate {m['prefix_cache_hit_rate']:.1%}, "
              f"TTFT p50 {m['ttft_p50_s']:.3f} s")


def print_measured(data: dict) -> None:
    """The wall-clock results written by ``benchmarks/paged_kv.py`` (its JSON), briefly."""
    env = data["environment"]
    print(f"{data['command']}\n{data['model']} on {data['device']}, {data['clock']} clock; torch {env['torch']}, "
          f"{env['cpu_count']} CPUs, {env['torch_threads']} threads; trace {data['trace']['num_requests']} requests")
    print_policy_table(data["reservation_vs_paged"])
    for row in data["reservation_vs_paged"]:
        if row.get("orca_max_new_tokens"):
            print(f"orca_max at {row['n_slots']} slots reserves prompt + {row['orca_max_new_tokens']} slots per "
                  f"request (the trace's longest output is {data['trace']['max_output_len']} tokens)")
    prefix = data["prefix_caching"]["policies"]
    print(f"prefix caching: hit rate {prefix['paged_prefix']['prefix_cache_hit_rate']:.1%}, prefill tokens "
          f"{prefix['paged']['num_prefill_tokens']} -> {prefix['paged_prefix']['num_prefill_tokens']}, TTFT p50 "
          f"{prefix['paged']['ttft_p50_s']:.3f} -> {prefix['paged_prefix']['ttft_p50_s']:.3f} s")
    cow = data["copy_on_write"]
    print(f"copy-on-write: n={cow['n']} samples of {cow['num_prompt_tokens']} tokens, "
          f"peak {cow['peak_slots_independent']} -> {cow['peak_slots_forked']} slots "
          f"({cow['bytes_saved'] / 2**20:.1f} MiB saved)")
    for mode, m in data["preemption"]["modes"].items():
        print(f"preemption {mode:<9}: {m['num_preemptions']} preemptions, {m['recomputed_tokens']} tokens recomputed, "
              f"{m['num_blocks_swapped_out']} blocks swapped out; {m['output_throughput_tok_s']:.1f} tok/s, "
              f"TTFT p50 {m['ttft_p50_s']:.2f} s, E2E p50 {m['e2e_p50_s']:.2f} s")
    same = [row["same_outputs"] for row in data["reservation_vs_paged"]] + [
        data[k]["same_outputs"] for k in ("prefix_caching", "copy_on_write", "preemption")]
    print(f"same greedy tokens within every experiment: {all(same)}")


# ---------------------------------------------------------------------- block tables and the exercises
def print_block_tables(trace: list[StepRecord], num_blocks: int, steps=None) -> None:
    """One line per step: the block_table of each request in the step's batch, the blocks no
    request holds during the step, and who was preempted (before it ran) or finished in it."""
    for record in trace if steps is None else [trace[i] for i in steps]:
        used = {b for t in record.block_tables.values() for b in t}
        tables = "  ".join(f"{rid} {list(t)}" for rid, t in record.block_tables.items())
        notes = "".join(f"  {what} {','.join(ids)}" for what, ids in
                        (("preempted", record.preempted), ("finished", record.finished)) if ids)
        print(f"step {record.step:>2}: {tables}  | free {num_blocks - len(used)}{notes}")


def free_blocks(record: StepRecord, num_blocks: int) -> int:
    """The blocks no request holds during the step of ``record`` (shared blocks counted once)."""
    return num_blocks - len({b for t in record.block_tables.values() for b in t})


def fork_run(prompt_len: int = 10, n: int = 3, max_new_tokens: int = 8, num_blocks: int = 16,
             block_size: int = 4, seed: int = 0) -> list[StepRecord]:
    """Parallel sampling on the SimExecutor: a request with a ``prompt_len``-token prompt forked into ``n`` samples
    (``fork_requests``: the children share the parent's prompt blocks, copy-on-write), in a paged cache of
    ``num_blocks`` blocks of ``block_size`` slots. Returns the engine's trace."""
    from minibatch import Request, SamplingParams, SimClock, SimExecutor, make_engine
    from minibatch.request import fork_requests

    sampling = SamplingParams(temperature=1.0, seed=seed, ignore_eos=True)
    engine = make_engine("paged", SimExecutor(), SimClock(), max_num_seqs=max(8, n), n_slots=num_blocks * block_size,
                         block_size=block_size)
    engine.generate(fork_requests(Request("s", [5] * prompt_len, max_new_tokens, sampling), n))
    return engine.trace


@exercise.check(hint="the children share the parent's full prompt blocks; a shared block a child writes into is "
                     "copied first; a sample takes a new block at the step that writes the block's first position")
def check_fork_prediction(prediction: dict, trace: list[StepRecord], num_blocks: int, steps=(1, 4),
                          show_answer: bool = False) -> str:
    """The exercise: ``prediction`` = {"step S": free blocks during step S} for each S of ``steps``, against the
    forked run's ``trace`` (a miss names the first wrong step, "too low" or "too high")."""
    measured = {f"step {s}": free_blocks(trace[s], num_blocks) for s in steps}
    exercise.expect(prediction, measured, show_answer=show_answer)
    return ", ".join(f"{k}: {v} of {num_blocks} blocks free" for k, v in measured.items()) + ", as in the engine"


@exercise.check(hint="a request takes a block at the step that writes the block's first position; with none free, "
                     "the running request that arrived last is preempted")
def check_first_preemption(prediction: dict, trace: list[StepRecord], show_answer: bool = False) -> str:
    """The exercise: ``prediction`` = {"step": int, "preempted": request id}, the first preemption in ``trace``
    (a miss says "too early" / "too late" for the step; ``show_answer`` also prints the engine's answer)."""
    first = next((record for record in trace if record.preempted), None)
    measured = {"step": first.step, "preempted": first.preempted[0]} if first else None
    exercise.expect(prediction, measured, show_answer=show_answer, words=("too early", "too late"))
    return f"the engine's first preemption is at step {first.step}, of {first.preempted[0]}"
