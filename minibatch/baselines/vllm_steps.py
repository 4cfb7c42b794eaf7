"""vLLM's step times for the step profile's shapes (``python -m minibatch profile --vllm-python PATH``).

One vLLM engine (the peer environment's, its default compiled mode, prefix caching off, the model's dtype) runs
one phase per shape, each to completion before the next (``vllm_worker.py``'s ``phases``):

* decode B: B requests of ``context_len`` random prompt tokens at once, ``repeats`` + 3 output tokens each
  (ignore_eos); once every request has its first token, every later step is a decode of all B, and the step time is
  the median gap between those steps;
* prefill N: one request of N random tokens and one output token, ``repeats`` times; the step time is the median
  time to its token.

Times are what vLLM's frontend sees after each ``LLMEngine.step()`` (its engine core runs in another process), so
they include the hand-over between the two processes, as a user of vLLM gets them.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch


def decode_step_s(phase: dict) -> float:
    """The median time between decode steps of a decode phase's result, once every request has a token."""
    times = [r["token_times_s"] for r in phase["requests"].values()]
    ready = max(t[0] for t in times)
    steps = sorted({s for t in times for s in t if s > ready})
    gaps = [b - a for a, b in zip([ready] + steps, steps)]
    if not gaps:
        raise RuntimeError("vllm gave no decode step after the prefills (too few output tokens)")
    return statistics.median(gaps)


def vllm_step_times(model, shapes: list[tuple[str, int]], context_len: int, repeats: int, python: str,
                    seed: int = 0) -> tuple[list[float], dict]:
    """Seconds per step of each (kind, size) shape on vLLM (see the module docstring), and vLLM's version and
    settings.

    Raises:
        RuntimeError: vLLM failed (the last lines of its output)."""
    from minibatch.baselines.vllm_peer import WARMUP, model_directory, model_kv_bytes_per_token, run_worker

    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().num_embeddings
    prompt = lambda n: torch.randint(10, vocab, (n,), generator=gen).tolist()  # noqa: E731
    request = lambda rid, n, out: {"request_id": rid, "prompt_token_ids": prompt(n), "max_tokens": out,  # noqa: E731
                                   "ignore_eos": True, "arrival_time_s": 0.0}
    phases, counted = [], []
    for kind, size in shapes:
        if kind == "decode":
            phases.append([request(f"d{size}-{i}", context_len, repeats + 3) for i in range(size)])
            counted.append(1)
        else:
            phases += [[request(f"p{size}-{k}", size, 1)] for k in range(repeats)]
            counted.append(repeats)
    longest_decode = max([size for kind, size in shapes if kind == "decode"], default=1)
    longest_prompt = max([size for kind, size in shapes if kind == "prefill"], default=0)
    max_len = max(context_len + repeats + 3, longest_prompt + 1) + 16
    kv_tokens = max(longest_decode * max_len, 16384)  # vLLM's CPU blocks are large: room for a few
    engine = dict(dtype=str(model.dtype).removeprefix("torch."), skip_tokenizer_init=True,
                  max_num_seqs=longest_decode, max_num_batched_tokens=max(4096, longest_prompt), max_model_len=max_len,
                  kv_cache_memory_bytes=kv_tokens * model_kv_bytes_per_token(model), enable_prefix_caching=False,
                  seed=0)
    with tempfile.TemporaryDirectory(prefix="minibatch-vllm-") as tmp:
        job = {"engine": engine | {"model": model_directory(model, Path(tmp))},
               "env": {"VLLM_CONFIGURE_LOGGING": "0"}, "warmup": WARMUP, "phases": phases}
        result = run_worker(python, job, Path(tmp))
    out, i = [], 0
    for (kind, _), n in zip(shapes, counted):
        done = result["phases"][i:i + n]
        i += n
        out.append(decode_step_s(done[0]) if kind == "decode" else
                   statistics.median(r["token_times_s"][0] for p in done for r in p["requests"].values()))
    return out, {"engine": "vllm", "version": result["vllm_version"], "python": python, "settings": engine,
                 "step_times": "frontend-observed, once per LLMEngine.step"}


def add_vllm_steps(rows: list[dict], shapes: list[tuple[str, int]], rounds: list[list[float]]) -> None:
    """Add vLLM's step time to each step profile row (one per shape, with ``bound_s``, ``step_s`` and, from several
    rounds, ``round_step_s``) and print it: ``rounds``, vLLM's seconds per shape in each round
    (:func:`vllm_step_times`, run right after our round of the same index). ``vllm_step_s``: the median over the
    rounds (``vllm_round_step_s``: each round's); ``ours_over_vllm``: the median of the rounds' ratios, ours over
    vLLM's (each pair timed minutes apart, not hours); ``vllm_over_bound``: ``vllm_step_s`` over the bound."""
    for i, (row, (kind, size)) in enumerate(zip(rows, shapes)):
        theirs = [times[i] for times in rounds]
        ours = row.get("round_step_s", [row["step_s"]])
        t = statistics.median(theirs)
        row |= {"vllm_step_s": t, "vllm_round_step_s": theirs, "vllm_over_bound": round(t / row["bound_s"], 2),
                "ours_over_vllm": round(statistics.median(a / b for a, b in zip(ours, theirs)), 3)}
        print(f"{kind} {size:>5}: vLLM {t * 1e3:7.1f} ms ({row['vllm_over_bound']:.1f}x its bound); ours "
              f"{row['ours_over_vllm']:.2f}x vLLM's" + (f" (median of {len(theirs)} rounds' ratios)"
                                                         if len(theirs) > 1 else ""))
