"""Run a trace on vLLM's engine and write what happened: ``python vllm_worker.py JOB.json RESULT.json``.

A standalone script (standard library and ``vllm`` only): ``minibatch.baselines.vllm_peer`` runs it with a Python
interpreter that has vLLM, usually a separate virtual environment, since vLLM pins its own torch and transformers.

JOB.json: ``engine`` (keyword arguments of ``vllm.LLM``: model directory, dtype, max_num_seqs, ...), ``env``
(environment variables set before vLLM is imported), ``warmup`` (requests run first and not timed) and
``requests``: each ``request_id``, ``prompt_token_ids``, ``max_tokens``, ``ignore_eos``, ``stop_token_ids``,
``logprobs`` (None or k), ``arrival_time_s`` (seconds from the start of the timed run; all 0 for a saturated trace).
Instead of ``requests``, ``phases`` (a list of such request lists) runs each list to completion in turn, timed from
its own start (``python -m minibatch profile --vllm-python``: one engine load for every step shape).

RESULT.json: ``vllm_version``, ``load_s``, ``warmup_s``, ``run_time_s`` and ``requests`` (with ``phases``: a list
of {``run_time_s``, ``requests``}, one per phase), per request ``output_token_ids``,
``token_times_s`` (when our loop saw each token, s from the start), ``finish_reason`` and ``logprobs`` (per
output token: token id -> logprob). Times are taken in this process after each ``LLMEngine.step()``: vLLM's
engine core runs in another process and hands tokens over once per step, so these are the times a frontend sees
them (what an API server would stream), not the moments the GPU/CPU produced them.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run_job(job: dict) -> dict:
    os.environ.update({k: str(v) for k, v in job.get("env", {}).items()})
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**job["engine"])
    engine = llm.llm_engine
    load_s = time.perf_counter() - t0

    def params(r: dict) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                              stop_token_ids=r.get("stop_token_ids") or None, logprobs=r.get("logprobs"),
                              detokenize=False)

    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in job["warmup"]],
                 [params(r) for r in job["warmup"]], use_tqdm=False)
    warmup_s = time.perf_counter() - t0

    def run(requests: list[dict]) -> dict:
        pending = sorted(requests, key=lambda r: r["arrival_time_s"])
        results, ours = {}, {}
        start = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while pending and pending[0]["arrival_time_s"] <= now:
                r = pending.pop(0)
                vid = engine.add_request(r["request_id"], TokensPrompt(prompt_token_ids=r["prompt_token_ids"]),
                                         params(r))
                ours[vid] = ours[r["request_id"]] = r["request_id"]
                results[r["request_id"]] = {"output_token_ids": [], "token_times_s": [], "finish_reason": None,
                                            "logprobs": []}
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, pending[0]["arrival_time_s"] - now))
                continue
            outputs = engine.step()
            seen = time.perf_counter() - start
            for out in outputs:
                res, completion = results[ours[out.request_id]], out.outputs[0]
                new = list(completion.token_ids)[len(res["output_token_ids"]):]
                res["output_token_ids"] += new
                res["token_times_s"] += [seen] * len(new)
                if completion.logprobs:
                    res["logprobs"] = [{str(t): lp.logprob for t, lp in pos.items()} for pos in completion.logprobs]
                if out.finished:
                    res["finish_reason"] = completion.finish_reason
        return {"run_time_s": time.perf_counter() - start, "requests": results}

    out = {"vllm_version": vllm.__version__, "load_s": load_s, "warmup_s": warmup_s}
    if "phases" in job:
        return out | {"phases": [run(requests) for requests in job["phases"]]}
    return out | run(job["requests"])


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn: this guard is required
    with open(sys.argv[1]) as f:
        result = run_job(json.load(f))
    tmp = sys.argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, sys.argv[2])  # a failed run never leaves a half-written result
