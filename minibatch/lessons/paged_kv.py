"""Measurements for notebook 04 (paged KV cache) and ``benchmarks/paged_kv.py``.

vLLM (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP'23) stores the KV cache in fixed-size blocks handed out on demand (§4.1,
§4.2), shares blocks between requests by reference counting (§4.4: parallel sampling with
copy-on-write, shared prefixes), and preempts by recompute or swap when blocks run out (§4.5).
The engine pieces are ``minibatch/kv/block_manager.py`` and ``minibatch/scheduler/paged.py``;
this module runs them and returns plain dicts (JSON-ready), so the notebook and the benchmark
script measure the same way:

* :func:`reservation_vs_paged`: one trace, the same KV memory, Orca's reservation vs paged blocks;
* :func:`prefix_caching_experiment`: requests sharing a system prompt, without and with the cache;
* :func:`cow_experiment`: parallel sampling (fork + copy-on-write) vs the same requests unshared;
* :func:`preemption_experiment`: recompute vs swap under memory pressure;
* :func:`kernel_check`: the Triton kernels against their torch references.

Units: a *slot* holds one token's K and V in every layer; sizes are in slots unless a name says
blocks or bytes; times are seconds (``_s``) on the engine clock (SimClock or WallClock).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from minibatch.engine import Engine, StepRecord
from minibatch.metrics import summarize
from minibatch.policies import make_engine
from minibatch.request import Request, SamplingParams, fork_requests
from minibatch.scheduler.orca import OrcaScheduler

GREEDY = SamplingParams(ignore_eos=True)  # every request runs to exactly max_new_tokens
POLICIES = ("orca", "orca_max", "paged", "paged_prefix")

# vLLM's claim (Kwon et al. SOSP'23, §1 and Figure 2, measured in the §6.2 experiment): in the
# existing systems only 20.4%-38.2% of the KV cache memory holds actual token states (so 60-80% is
# wasted on reservation and internal/external fragmentation); in vLLM 96.3% does (under 4% waste).
# Their baselines (§6.1) are their own Orca: "Oracle" reserves the true output length, "Pow2"
# up to 2x it, "Max" the model's maximum sequence length (2048 tokens).
VLLM_CLAIM = {"existing_systems_waste": (1 - 0.382, 1 - 0.204), "vllm_waste": 1 - 0.963,
              "source": "Kwon et al., SOSP'23, Section 1 and Figure 2"}


# ---------------------------------------------------------------------- running one policy
def policy_engine(policy: str, executor, clock, *, n_slots: int, max_num_seqs: int = 32, block_size: int = 16,
                  orca_max_new_tokens: int | None = None, preemption_mode: str = "recompute") -> Engine:
    """An Engine for one of POLICIES over ``n_slots`` KV slots. "orca" keeps Orca's per-token
    slots (block_size 1: its only waste is the reservation) and reserves prompt +
    max_new_tokens; "orca_max" is the same scheduler reserving prompt + max(max_new_tokens,
    ``orca_max_new_tokens``) (OrcaScheduler's ``reserve_new_tokens``: vLLM's "Orca (Max)");
    "paged" and "paged_prefix" use blocks of ``block_size``.

    Raises:
        ValueError: an unknown policy, or "orca_max" without orca_max_new_tokens.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy == "orca_max" and orca_max_new_tokens is None:
        raise ValueError("policy 'orca_max' needs orca_max_new_tokens (the server's reservation)")
    return make_engine("orca" if policy == "orca_max" else policy, executor, clock, max_num_seqs=max_num_seqs, n_slots=n_slots,
                       block_size=block_size if policy.startswith("paged") else None, preemption_mode=preemption_mode,
                       reserve_new_tokens=orca_max_new_tokens if policy == "orca_max" else None)


def run_policy(policy: str, requests: list[Request], executor, clock, **kwargs) -> tuple[list[Request], Engine]:
    """Run fresh copies of ``requests`` to completion under ``policy`` (see :func:`policy_engine`)."""
    reqs = [r.copy() for r in requests]
    engine = policy_engine(policy, executor, clock, **kwargs)
    engine.generate(reqs)
    return reqs, engine


def num_prefill_tokens(trace: list[StepRecord]) -> dict[str, int]:
    """request_id -> prompt (and recomputed) tokens computed in prefill steps over the trace."""
    out: dict[str, int] = {}
    for record in trace:
        for e in record.entries:
            if e.phase == "prefill":
                out[e.request_id] = out.get(e.request_id, 0) + e.num_new_tokens
    return out


def run_metrics(policy: str, requests: list[Request], engine: Engine) -> dict:
    """The numbers every experiment reports for one finished run (a JSON-ready dict).

    kv_waste_fraction: 1 - used / reserved KV slots, summed over steps (metrics.kv_waste_fraction:
    the reservation and the empty tail of each last block). kv_usage_fraction: mean over steps of
    slots holding computed tokens / n_slots (how full of real KV the memory is).
    """
    s = summarize(requests, engine.trace)
    n_slots = engine.scheduler.block_manager.num_slots
    trace = engine.trace
    return {
        "policy": policy, "clock": engine.clock.kind, "n_slots": n_slots, "num_requests": len(requests),
        "kv_waste_fraction": s.kv_waste_fraction,
        "kv_usage_fraction": sum(r.num_kv_slots_used for r in trace) / (len(trace) * n_slots),
        "max_num_running": s.max_num_running, "mean_batch_size": s.mean_batch_size,
        "output_throughput_tok_s": s.output_throughput_tok_s, "duration_s": s.duration_s,
        "ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s, "e2e_p50_s": s.e2e_p50_s, "e2e_p99_s": s.e2e_p99_s,
        "num_preemptions": s.num_preemptions, "num_steps": s.num_steps,
        "num_prefill_tokens": sum(num_prefill_tokens(trace).values()),
    }


def _same_outputs(runs: dict[str, list[Request]]) -> bool:
    outputs = [[r.output_token_ids for r in reqs] for reqs in runs.values()]
    return all(o == outputs[0] for o in outputs)


# ---------------------------------------------------------------------- 1. reservation vs paged
def reservation_vs_paged(requests: list[Request], executor, clock_factory: Callable, n_slots: int, max_num_seqs: int = 32,
                         block_size: int = 16, policies=("orca", "paged", "paged_prefix"),
                         orca_max_new_tokens: int | None = None) -> dict:
    """The same trace in the same KV memory (``n_slots`` slots) under each policy.

    "orca" is Orca's Algorithm 1 reserving prompt + the request's own max_new_tokens. With
    ``ignore_eos`` traces that is the exact output length, an oracle: Orca's best case (vLLM's
    "Orca (Oracle)", §6.1). A real server does not know the output length and reserves its
    max_new_tokens; set ``orca_max_new_tokens`` (e.g. 2048) to also run "orca_max", which
    reserves prompt + max(max_new_tokens, that) and still stops at the true length, so it
    computes the same tokens. A request whose orca_max reservation exceeds n_slots could never
    be admitted: that policy's entry is then {"policy", "skipped": reason}.

    clock_factory: a fresh clock per run, e.g. ``SimClock`` or ``WallClock``.
    Returns {"n_slots", "max_num_seqs", "block_size", "orca_max_new_tokens", "policies": {name:
    :func:`run_metrics`}, "same_outputs": every policy that ran produced the same tokens}.
    """
    policies = tuple(policies) + (("orca_max",) if orca_max_new_tokens and "orca_max" not in policies else ())
    result = {"n_slots": n_slots, "max_num_seqs": max_num_seqs, "block_size": block_size,
              "orca_max_new_tokens": orca_max_new_tokens, "policies": {}}
    runs = {}
    for policy in policies:
        if policy == "orca_max":  # a reservation larger than the whole cache could never be admitted
            too_big = _orca_max_too_big(requests, n_slots, orca_max_new_tokens)
            if too_big:
                result["policies"][policy] = {"policy": policy, "skipped": too_big}
                continue
        reqs, engine = run_policy(policy, requests, executor, clock_factory(), n_slots=n_slots, max_num_seqs=max_num_seqs,
                                  block_size=block_size, orca_max_new_tokens=orca_max_new_tokens)
        runs[policy] = reqs
        result["policies"][policy] = run_metrics(policy, reqs, engine)
    result["same_outputs"] = _same_outputs(runs)
    return result


def _orca_max_too_big(requests: list[Request], n_slots: int, reserve_new_tokens: int | None) -> str | None:
    """Why "orca_max" cannot run this trace in n_slots (OrcaScheduler.check_request's message
    for the first request that does not fit), or None."""
    scheduler = OrcaScheduler(n_slots=n_slots, reserve_new_tokens=reserve_new_tokens)
    for r in requests:
        try:
            scheduler.check_request(r)
        except ValueError as e:
            return str(e)
    return None


def expected_kv_waste(requests: list[Request], policy: str, block_size: int = 16,
                      reserve_new_tokens: int | None = None) -> float:
    """kv_waste_fraction predicted from the lengths alone, for a run without preemption.

    A StepRecord is taken after the step's update, so a request with prompt P and O output
    tokens appears in O - 1 records (its last step frees it), holding c = P + k computed
    tokens, k = 0 .. O - 2. It reserves P + O slots in each (Orca; P + max(O, cap) for
    orca_max) or ceil(c / block_size) blocks (paged). Summed over steps, every running request
    counts once per step whoever it shares the batch with, so the fraction does not depend on
    the schedule or on n_slots: only on the reservation rule and the lengths.
    """
    used = reserved = 0
    for r in requests:
        p, o = r.num_prompt_tokens, r.max_new_tokens
        for c in range(p, p + o - 1):
            used += c
            if policy == "orca":
                reserved += p + o
            elif policy == "orca_max":
                reserved += p + max(o, reserve_new_tokens or o)
            else:
                reserved += -(-c // block_size) * block_size
    return 1.0 - used / reserved if reserved else 0.0


def waste_sweep(requests: list[Request], executor, clock_factory: Callable, n_slots_list, **kwargs) -> list[dict]:
    """:func:`reservation_vs_paged` at each n_slots (keyword arguments passed on)."""
    return [reservation_vs_paged(requests, executor, clock_factory, n, **kwargs) for n in n_slots_list]


POLICY_STYLE = {"orca": ("#0072B2", "o", "orca (reserves the true length: oracle)"),
                "orca_max": ("#D55E00", "s", "orca, reserving {cap} new tokens"),
                "paged": ("#009E73", "^", "paged"), "paged_prefix": ("#CC79A7", "v", "paged + prefix caching")}


def plot_waste_sweep(sweep: list[dict], claim: dict = VLLM_CLAIM):
    """Two panels over n_slots: KV waste (%) with vLLM's reported ranges shaded, and the most
    requests running at once. Returns the Figure."""
    import matplotlib.pyplot as plt

    fig, (ax_w, ax_c) = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    lo, hi = claim["existing_systems_waste"]
    ax_w.axhspan(100 * lo, 100 * hi, color="#DDDDDD", zorder=0, label="vLLM paper: existing systems")
    ax_w.axhline(100 * claim["vllm_waste"], color="#777777", linestyle="--", linewidth=1, label="vLLM paper: vLLM")
    names = [p for p in POLICY_STYLE if any(p in row["policies"] for row in sweep)]
    for name in names:
        color, marker, label = POLICY_STYLE[name]
        label = label.format(cap=sweep[0].get("orca_max_new_tokens"))
        pts = [(row["n_slots"], row["policies"][name]) for row in sweep
               if "skipped" not in row["policies"].get(name, {"skipped": True})]
        xs = [x for x, _ in pts]
        ax_w.plot(xs, [100 * m["kv_waste_fraction"] for _, m in pts], marker=marker, color=color, label=label)
        ax_c.plot(xs, [m["max_num_running"] for _, m in pts], marker=marker, color=color, label=label)
    for ax, ylabel in ((ax_w, "KV waste, % of reserved slots"), (ax_c, "max requests running at once")):
        ax.set_xscale("log", base=2)
        ax.set_xticks([row["n_slots"] for row in sweep], [str(row["n_slots"]) for row in sweep])
        ax.minorticks_off()
        ax.set_xlabel("KV memory, n_slots (token slots)")
        ax.set_ylabel(ylabel)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    ax_w.set_ylim(0, 100)
    ax_w.legend(fontsize=7, frameon=False, loc="upper right", bbox_to_anchor=(1.0, 0.58))
    ax_c.set_ylim(bottom=0)
    return fig


# ---------------------------------------------------------------------- 2. prefix caching
# A system prompt (our own words) of ~150 SmolLM2 tokens that every request of a chat app sends first.
SYSTEM_PROMPT = (
    "You are Juniper, the help-desk assistant of a small public library. Answer in plain English, "
    "in at most three short paragraphs, and be friendly but brief. If a question is about opening "
    "hours, the catalogue, renewals, fines, room bookings, printing or the children's reading club, "
    "answer it directly. If it is about anything else, answer it as well as you can, and say when "
    "you are not sure. Never invent book titles, authors, dates or prices. Do not ask for a "
    "library card number, an address or a password, and remind people not to share them. When a "
    "question is unclear, ask one short follow-up question instead of guessing. Use lists only "
    "when the user asks for steps. End every answer with one sentence that invites a follow-up."
)


def system_and_user_ids(tokenizer, system_text: str, user_texts: list[str]) -> tuple[list[int], list[list[int]]]:
    """Token ids of a shared system turn and of each user turn that follows it, so that
    ``system_ids + user_ids[i]`` is request i's prompt. With a chat template the system part is
    the template rendered with the system message alone, and each user part is the rest of the
    full rendering (user turn + generation prompt); without one, plain encodes joined by a blank
    line."""
    if getattr(tokenizer, "chat_template", None):
        system = tokenizer.apply_chat_template([{"role": "system", "content": system_text}], tokenize=False)
        users = []
        for text in user_texts:
            full = tokenizer.apply_chat_template([{"role": "system", "content": system_text},
                                                  {"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
            if not full.startswith(system):
                raise ValueError("the chat template does not render the system turn as a prefix")
            users.append(list(tokenizer.encode(full[len(system):], add_special_tokens=False)))
        return list(tokenizer.encode(system, add_special_tokens=False)), users
    return (list(tokenizer.encode(system_text + "\n\n", add_special_tokens=False)),
            [list(tokenizer.encode(t, add_special_tokens=False)) for t in user_texts])


def prefix_caching_experiment(runner, clock_factory: Callable, system_prompt_ids: list[int],
                              user_prompts: list[list[int]], max_new_tokens: int = 8, gap_s: float = 0.5,
                              block_size: int = 16, n_slots: int = 4096, max_num_seqs: int = 32) -> dict:
    """Requests "u0", "u1", ... = system prompt + user prompt i, arriving ``gap_s`` apart,
    greedy, under "paged" and "paged_prefix" (vLLM's automatic prefix caching, §4.4 "shared
    prefix").

    With the cache a request finds the system prompt's full blocks of earlier requests by hash
    and computes only the rest of its prompt (the last prompt token is always computed: its
    logits are sampled). Returns {"num_system_prompt_tokens", "num_shared_blocks" (full blocks
    of the system prompt), "policies": {name: run_metrics + prefix_cache_hit_rate,
    num_prefix_hit_tokens}, "requests": per request prompt length, prefill tokens and TTFT
    under both, "same_outputs"}.
    """
    requests = [Request(f"u{i}", list(system_prompt_ids) + list(ids), max_new_tokens, GREEDY, arrival_time_s=gap_s * i)
                for i, ids in enumerate(user_prompts)]
    result = {"num_system_prompt_tokens": len(system_prompt_ids), "block_size": block_size,
              "num_shared_blocks": len(system_prompt_ids) // block_size, "gap_s": gap_s, "policies": {}}
    runs, prefill = {}, {}
    for policy in ("paged", "paged_prefix"):
        reqs, engine = run_policy(policy, requests, runner, clock_factory(), n_slots=n_slots, max_num_seqs=max_num_seqs,
                                  block_size=block_size)
        bm = engine.scheduler.block_manager
        runs[policy], prefill[policy] = reqs, num_prefill_tokens(engine.trace)
        result["policies"][policy] = {**run_metrics(policy, reqs, engine), "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
                                      "num_prefix_hit_tokens": bm.num_prefix_hit_tokens}
    result["requests"] = [
        {"request_id": a.request_id, "num_prompt_tokens": a.num_prompt_tokens,
         "prefill_tokens": prefill["paged"][a.request_id], "prefill_tokens_prefix": prefill["paged_prefix"][a.request_id],
         "ttft_s": a.first_token_time_s - a.arrival_time_s, "ttft_prefix_s": b.first_token_time_s - b.arrival_time_s}
        for a, b in zip(runs["paged"], runs["paged_prefix"])]
    result["same_outputs"] = _same_outputs(runs)
    return result


# ---------------------------------------------------------------------- 3. copy-on-write
def cow_experiment(runner, prompt_ids: list[int], n: int = 4, max_new_tokens: int = 8, block_size: int = 16,
                   n_slots: int = 4096, sampling: SamplingParams = GREEDY, clock_factory: Callable | None = None) -> dict:
    """Parallel sampling: ``n`` samples of one prompt, forked (``fork_requests``: the children
    share the parent's prompt blocks, ref_cnt + 1 each, copy-on-write; vLLM §4.4) vs the same n
    requests without parent_request_id (each computes and stores the prompt itself).

    Peak memory is the most KV slots in use in any step (num_kv_slots_reserved: whole blocks).
    When all n run with no block grown meanwhile, sharing saves (n - 1) * ((P - 1) // block_size)
    blocks: each child shares every full block before its last prompt position P - 1, which it
    writes again (it samples its own first token) into a private copy of that block.

    Returns {"n", "num_prompt_tokens", "block_size", "peak_slots_forked", "peak_slots_independent",
    "slots_saved", "expected_slots_saved", "kv_bytes_per_token", "bytes_saved" (None without a
    model), "num_blocks_copied" (copy-on-write), "ref_cnts" (request_id -> ref_cnt of each block
    of its block_table, the first step all n run), "same_outputs" (each forked sample equals its
    unshared twin), "num_distinct_outputs"}.
    """
    from minibatch.clock import SimClock

    clock_factory = clock_factory or SimClock
    group = fork_requests(Request("s", list(prompt_ids), max_new_tokens, sampling), n)
    engine = make_engine("paged", runner, clock_factory(), max_num_seqs=max(n, 8), n_slots=n_slots, block_size=block_size)
    for r in group:
        engine.add_request(r)
    bm, ref_cnts = engine.scheduler.block_manager, None
    while engine.has_unfinished():
        engine.step()
        if ref_cnts is None and len(engine.scheduler.running) == n:  # every sample holds its blocks now
            ref_cnts = {r.request_id: [bm.blocks[b].ref_cnt for b in bm.block_tables[r.request_id]]
                        for r in engine.scheduler.running}
    alone = [r.copy() for r in group]
    for r in alone:
        r.parent_request_id = None
    alone_engine = make_engine("paged", runner, clock_factory(), max_num_seqs=max(n, 8), n_slots=n_slots, block_size=block_size)
    alone_engine.generate(alone)
    peak_forked = max(s.num_kv_slots_reserved for s in engine.trace)
    peak_alone = max(s.num_kv_slots_reserved for s in alone_engine.trace)
    kv_bytes = getattr(runner, "kv_bytes_per_token", None)
    p = len(prompt_ids)
    return {
        "n": n, "num_prompt_tokens": p, "block_size": block_size, "max_new_tokens": max_new_tokens,
        "peak_slots_forked": peak_forked, "peak_slots_independent": peak_alone, "slots_saved": peak_alone - peak_forked,
        "expected_slots_saved": (n - 1) * ((p - 1) // block_size) * block_size,
        "kv_bytes_per_token": kv_bytes, "bytes_saved": None if kv_bytes is None else (peak_alone - peak_forked) * kv_bytes,
        "num_blocks_copied": sum(rec.num_blocks_copied for rec in engine.trace), "ref_cnts": ref_cnts,
        "same_outputs": [r.output_token_ids for r in group] == [r.output_token_ids for r in alone],
        "num_distinct_outputs": len({tuple(r.output_token_ids) for r in group}),
    }


# ---------------------------------------------------------------------- 4. preemption
def recomputed_tokens(trace: list[StepRecord], requests: list[Request]) -> int:
    """Tokens computed again after a recompute preemption: each request's prefill tokens over
    the trace beyond its prompt (prefix caching off; a preempted request prefills its prompt
    and the tokens it had generated again)."""
    prefill = num_prefill_tokens(trace)
    return sum(prefill.get(r.request_id, 0) - r.num_prompt_tokens for r in requests)


def preemption_experiment(requests: list[Request], executor, clock_factory: Callable, n_slots: int,
                          modes=("recompute", "swap"), max_num_seqs: int = 32, block_size: int = 16) -> dict:
    """The same trace under "paged" with each preemption mode (vLLM §4.5), in ``n_slots`` slots
    small enough that running requests run out of blocks.

    recompute: the victim's blocks are freed; it later prefills prompt + generated tokens again.
    swap: its blocks are copied to CPU memory and back (as many CPU blocks as GPU blocks; if they
    run out the victim is recomputed instead).
    Returns {"n_slots", "block_size", "modes": {mode: run_metrics + recomputed_tokens,
    num_preempted_requests, num_blocks_swapped_out/in, swapped_bytes (None without a model)},
    "same_outputs"}.
    """
    result = {"n_slots": n_slots, "block_size": block_size, "max_num_seqs": max_num_seqs, "modes": {}}
    runs = {}
    kv_bytes = getattr(executor, "kv_bytes_per_token", None)
    for mode in modes:
        reqs, engine = run_policy("paged", requests, executor, clock_factory(), n_slots=n_slots, max_num_seqs=max_num_seqs,
                                  block_size=block_size, preemption_mode=mode)
        runs[mode] = reqs
        out = sum(rec.num_blocks_swapped_out for rec in engine.trace)
        back = sum(rec.num_blocks_swapped_in for rec in engine.trace)
        result["modes"][mode] = {
            **run_metrics(f"paged ({mode})", reqs, engine),
            "recomputed_tokens": recomputed_tokens(engine.trace, reqs),
            "num_preempted_requests": sum(r.num_preemptions > 0 for r in reqs),
            "num_blocks_swapped_out": out, "num_blocks_swapped_in": back,
            "swapped_bytes": None if kv_bytes is None else (out + back) * block_size * kv_bytes,
        }
    result["same_outputs"] = _same_outputs(runs)
    return result


# ---------------------------------------------------------------------- 5. kernels
def kernel_check(seq_lens=(5, 11, 18), q_lens=(5, 1, 4), block_size: int = 4, num_heads: int = 4,
                 num_kv_heads: int = 2, head_dim: int = 16, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", seed: int = 0) -> dict:
    """Run the Triton kernels and their torch references on one small random paged cache.

    Requests with context lengths ``seq_lens`` hold shuffled, non-contiguous blocks. store_kv
    writes every context token's K/V (Triton into one cache, the reference into another);
    decode attention takes one query per request at its last position; prefill attention takes
    the last ``q_lens`` positions of each request as packed causal queries. Returns the max
    absolute differences (Triton - reference) and each call's time in ms ("timings_ms"; under
    TRITON_INTERPRET=1 the kernels run in numpy, orders of magnitude slower than on a GPU), or
    {"skipped": reason} when the kernels cannot run here.
    """
    from minibatch import kernels

    if not kernels.HAS_TRITON or (torch.device(device).type != "cuda" and not kernels.IS_INTERPRETED):
        return {"skipped": "triton is not installed, or the kernels are compiled for a GPU"}
    g = torch.Generator().manual_seed(seed)
    num_blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(num_blocks_per_req) + 2  # two blocks nobody owns
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(k)] for k in num_blocks_per_req]
    block_tables = torch.zeros(len(seq_lens), max(num_blocks_per_req), dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    slot_mapping = torch.tensor([t[p // block_size] * block_size + p % block_size
                                 for t, n in zip(tables, seq_lens) for p in range(n)])  # (num_tokens,)
    num_tokens = len(slot_mapping)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g, dtype=dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g, dtype=dtype)
    cache_shape = (1, 2, num_blocks, block_size, num_kv_heads, head_dim)  # one layer
    cache, cache_ref = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    key, value, slot_mapping, block_tables, cache, cache_ref = to(key, value, slot_mapping, block_tables, cache, cache_ref)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    q_dec = torch.randn(len(seq_lens), num_heads, head_dim, generator=g, dtype=dtype).to(device)
    q_pre = torch.randn(sum(q_lens), num_heads, head_dim, generator=g, dtype=dtype).to(device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    calls = {
        "store_kv": (lambda: kernels.store_kv(cache, 0, key, value, slot_mapping),
                     lambda: kernels.store_kv_ref(cache_ref, 0, key, value, slot_mapping)),
        "decode": (lambda: kernels.paged_decode_attention(q_dec, cache_ref, 0, block_tables, seq, scale),
                   lambda: kernels.paged_decode_attention_ref(q_dec, cache_ref, 0, block_tables, seq, scale)),
        "prefill": (lambda: kernels.paged_prefill_attention(q_pre, cache_ref, 0, block_tables, seq, cu, scale),
                    lambda: kernels.paged_prefill_attention_ref(q_pre, cache_ref, 0, block_tables, seq, cu, scale)),
    }
    result = {"device": device, "interpreted": kernels.IS_INTERPRETED, "dtype": str(dtype).removeprefix("torch."),
              "seq_lens": list(seq_lens), "q_lens": list(q_lens), "block_size": block_size, "timings_ms": {}}
    for name, (triton_fn, ref_fn) in calls.items():  # store_kv first: the attention calls read cache_ref
        outs = []
        for label, fn in (("triton", triton_fn), ("ref", ref_fn)):
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs.append(fn())
            if device != "cpu":
                torch.cuda.synchronize()
            result["timings_ms"][f"{name}_{label}"] = 1e3 * (time.perf_counter() - t0)
        a, b = (cache, cache_ref) if name == "store_kv" else outs
        result[f"{name}_max_abs_diff"] = float((a.float() - b.float()).abs().max())
    return result


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
    prefix = data["prefix_caching"]["policies"]
    print(f"prefix caching: hit rate {prefix['paged_prefix']['prefix_cache_hit_rate']:.1%}, prefill tokens "
          f"{prefix['paged']['num_prefill_tokens']} -> {prefix['paged_prefix']['num_prefill_tokens']}, TTFT p50 "
          f"{prefix['paged']['ttft_p50_s']:.3f} -> {prefix['paged_prefix']['ttft_p50_s']:.3f} s")
    cow = data["copy_on_write"]
    print(f"copy-on-write: n={cow['n']} samples of {cow['num_prompt_tokens']} tokens, peak {cow['peak_slots_independent']}"
          f" -> {cow['peak_slots_forked']} slots ({cow['bytes_saved'] / 2**20:.1f} MiB saved)")
    for mode, m in data["preemption"]["modes"].items():
        print(f"preemption {mode:<9}: {m['num_preemptions']} preemptions, {m['recomputed_tokens']} tokens recomputed, "
              f"{m['num_blocks_swapped_out']} blocks swapped out; {m['output_throughput_tok_s']:.1f} tok/s, "
              f"TTFT p50 {m['ttft_p50_s']:.2f} s, E2E p50 {m['e2e_p50_s']:.2f} s")
    same = [row["same_outputs"] for row in data["reservation_vs_paged"]] + [
        data[k]["same_outputs"] for k in ("prefix_caching", "copy_on_write", "preemption")]
    print(f"same greedy tokens within every experiment: {all(same)}")


# ---------------------------------------------------------------------- the block map and the exercise
def print_block_tables(trace: list[StepRecord], num_blocks: int, steps=None) -> None:
    """One line per step: the block_table of each request in the step's batch, the blocks no
    request holds during the step, and who was preempted (before it ran) or finished in it."""
    for record in trace if steps is None else [trace[i] for i in steps]:
        used = {b for t in record.block_tables.values() for b in t}
        tables = "  ".join(f"{rid} {list(t)}" for rid, t in record.block_tables.items())
        notes = "".join(f"  {what} {','.join(ids)}" for what, ids in
                        (("preempted", record.preempted), ("finished", record.finished)) if ids)
        print(f"step {record.step:>2}: {tables}  | free {num_blocks - len(used)}{notes}")


def draw_block_map(trace: list[StepRecord], num_blocks: int, title: str | None = None):
    """:func:`minibatch.viz.kv_block_map` with a red line before each step whose schedule
    preempted a request (the victim holds no block from that step on), labelled with its id.
    Returns the Figure."""
    import matplotlib.pyplot as plt

    from minibatch.viz import kv_block_map

    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.22 * num_blocks), layout="constrained")
    kv_block_map(trace, num_blocks, ax=ax)
    if title:
        ax.set_title(title, loc="left", fontsize=10, pad=16)
    for record in trace:
        if record.preempted:
            ax.axvline(record.step, color="#B00000", linewidth=1.2)
            ax.text(record.step, -0.15, "preempt " + ",".join(record.preempted), color="#B00000", fontsize=8,
                    ha="center", va="bottom", clip_on=False)
    return fig


def library_slot_mapping(block_table: list[int], num_computed_tokens: int, num_new_tokens: int,
                         block_size: int) -> list[int]:
    """The runner's slot_mapping for one request's new tokens (``minibatch.runner.batch``)."""
    from minibatch.runner.batch import context_slot_table

    seq_len = num_computed_tokens + num_new_tokens
    return context_slot_table([block_table], [seq_len], block_size)[0, num_computed_tokens:seq_len].tolist()


def check_slot_mapping(fn: Callable, trace: list[StepRecord], block_size: int) -> list[tuple]:
    """Compare a learner's ``fn(block_table, num_computed_tokens, num_new_tokens, block_size)``
    with the runner's slot_mapping on hand-picked cases and on every request of every step of
    ``trace``. Returns the mismatches as (case, expected, returned); [] means all correct."""
    cases = [([7, 2, 5], 0, 10, 4), ([7, 2, 5], 9, 1, 4), ([3], 2, 1, 4), ([4, 1], 3, 2, 4), ([0, 9, 8], 16, 1, 8)]
    for record in trace:
        for e in record.entries:
            cases.append((record.block_tables[e.request_id], e.num_computed_tokens, e.num_new_tokens, block_size))
    wrong = []
    for case in cases:
        expected, got = library_slot_mapping(*case), fn(*case)
        if got is None or [int(x) for x in got] != expected:
            wrong.append((case, expected, got))
    return wrong
