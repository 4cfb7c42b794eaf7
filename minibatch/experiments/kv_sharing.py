"""Shared KV blocks (vLLM, Kwon et al. SOSP'23 §4.4): prefix caching of a shared system prompt, and
parallel sampling with copy-on-write, for notebook 04 and ``benchmarks/paged_kv.py``.

Sizes are in KV slots (one token's K and V in every layer) unless a name says blocks or bytes;
times are seconds on the engine clock.
"""

from __future__ import annotations

from typing import Callable

from minibatch.experiment import run, same_outputs
from minibatch.experiments.paged_kv import GREEDY, num_prefill_tokens, run_metrics
from minibatch.policies import make_engine
from minibatch.request import Request, SamplingParams, fork_requests

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
    line.

    Raises:
        ValueError: the chat template does not render the system turn as a prefix.
    """
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
        runs[policy] = run(policy, requests, runner, clock_factory(), n_slots=n_slots, max_num_seqs=max_num_seqs,
                           block_size=block_size)
        prefill[policy] = num_prefill_tokens(runs[policy].records)
        stats = runs[policy].engine.scheduler.make_stats()
        result["policies"][policy] = {**run_metrics(runs[policy]), "prefix_cache_hit_rate":
                                      stats.get("prefix_cache_hit_rate", 0.0),
                                      "num_prefix_hit_tokens": stats.get("num_prefix_hit_tokens", 0)}
    result["requests"] = [
        {"request_id": a.request_id, "num_prompt_tokens": a.num_prompt_tokens,
         "prefill_tokens": prefill["paged"][a.request_id],
         "prefill_tokens_prefix": prefill["paged_prefix"][a.request_id],
         "ttft_s": a.first_token_time_s - a.arrival_time_s, "ttft_prefix_s": b.first_token_time_s - b.arrival_time_s}
        for a, b in zip(runs["paged"].requests, runs["paged_prefix"].requests)]
    result["same_outputs"] = same_outputs(r.requests for r in runs.values())
    return result


def cow_experiment(runner, prompt_ids: list[int], n: int = 4, max_new_tokens: int = 8, block_size: int = 16,
                   n_slots: int = 4096, sampling: SamplingParams = GREEDY,
                   clock_factory: Callable | None = None) -> dict:
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
    engine = make_engine("paged", runner, clock_factory(), max_num_seqs=max(n, 8), n_slots=n_slots,
                         block_size=block_size)
    for r in group:
        engine.add_request(r)
    ref_cnts = None
    while engine.has_unfinished():  # stepped by hand: the ref_cnts are read mid-run
        engine.step()
        if ref_cnts is None and len(engine.scheduler.running) == n:  # every sample holds its blocks now
            ref_cnts = {r.request_id: engine.scheduler.block_ref_counts(r.request_id)
                        for r in engine.scheduler.running}
    alone = [r.copy() for r in group]
    for r in alone:
        r.parent_request_id = None
    unshared = run("paged", alone, runner, clock_factory(), max_num_seqs=max(n, 8), n_slots=n_slots,
                   block_size=block_size)
    peak_forked = max(s.num_kv_slots_reserved for s in engine.trace)
    peak_alone = max(s.num_kv_slots_reserved for s in unshared.records)
    kv_bytes = getattr(runner, "kv_bytes_per_token", None)
    p = len(prompt_ids)
    return {
        "n": n, "num_prompt_tokens": p, "block_size": block_size, "max_new_tokens": max_new_tokens,
        "peak_slots_forked": peak_forked, "peak_slots_independent": peak_alone, "slots_saved": peak_alone - peak_forked,
        "expected_slots_saved": (n - 1) * ((p - 1) // block_size) * block_size,
        "kv_bytes_per_token": kv_bytes,
        "bytes_saved": None if kv_bytes is None else (peak_alone - peak_forked) * kv_bytes,
        "num_blocks_copied": sum(rec.num_blocks_copied for rec in engine.trace), "ref_cnts": ref_cnts,
        "same_outputs": same_outputs([group, unshared.requests]),
        "num_distinct_outputs": len({tuple(r.output_token_ids) for r in group}),
    }
