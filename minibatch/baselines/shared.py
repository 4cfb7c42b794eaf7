"""What the peer engines share on the Request side: input checks (the sampling each does not apply; a trace's
requests against the policies a comparison runs), the batch's one sampling setting, filling a Request from HF's
tokens and time stamps, and the progress bar.
"""

from __future__ import annotations

import dataclasses

from minibatch.checks import short_repr
from minibatch.request import Request, RequestStatus, SamplingParams


def max_model_len(model) -> int | None:
    """The model's context limit in tokens, read as ModelRunner reads it (None: its config sets none)."""
    from minibatch.runner.support import NO_POSITION_LIMIT, config_max_model_len

    max_len = config_max_model_len(model.config.get_text_config())
    return None if max_len == NO_POSITION_LIMIT else max_len


def check_requests(model, requests: list[Request], baseline: str) -> None:
    """Check a baseline's input before it runs (``baseline``: its policy name; a sampling field it does not apply,
    ``UNSUPPORTED``, is refused when set rather than silently ignored).

    Raises:
        ValueError: empty input, a duplicate request_id, a request that already ran (not WAITING, or with
            computed or output tokens), one that sets an unsupported field, or one whose prompt + max_new_tokens
            exceeds the model's context.
    """
    if not requests:
        raise ValueError("requests is empty: give at least one Request")
    seen: set[str] = set()
    for r in requests:
        if r.request_id in seen:
            raise ValueError(f"duplicate request_id {r.request_id!r}")
        seen.add(r.request_id)
        if r.status != RequestStatus.WAITING or r.num_computed_tokens or r.output_token_ids:
            raise ValueError(f"request {r.request_id!r} already ran; pass request.copy()")
        if field := unsupported_sampling(r, baseline):
            raise ValueError(f"request {r.request_id!r}: {baseline} does not apply sampling {field} "
                             f"({short_repr(getattr(r.sampling, field))}); leave it unset, or run one of our policies")
    max_len = max_model_len(model)
    if max_len is not None:
        for r in requests:
            if r.max_num_tokens > max_len:
                raise ValueError(
                    f"request {r.request_id!r}: prompt ({r.num_prompt_tokens}) + max_new_tokens "
                    f"({r.max_new_tokens}) must be <= max_model_len ({max_len})"
                )


# The SamplingParams fields each peer engine does not apply (refused when a request sets them, never ignored): HF's
# generate returns no logprobs and has no min_tokens, its continuous batching no per-request stop ids; our vLLM job
# passes neither min_tokens nor a request's own stop ids
UNSUPPORTED = {"hf_generate": ("min_tokens", "logprobs"), "vllm": ("min_tokens", "stop_token_ids"),
               "hf_generate_batch": ("min_tokens", "logprobs", "stop_token_ids")}


def unsupported_sampling(request: Request, baseline: str) -> str | None:
    """The first sampling field ``request`` sets that ``baseline`` does not apply (logprobs 0 is set), or None."""
    unset = {"logprobs": (None,)}
    return next((name for name in UNSUPPORTED.get(baseline, ())
                 if getattr(request.sampling, name) not in unset.get(name, (0, ()))), None)


def requests_for(policy: str, requests: list[Request], rule: str) -> list[Request]:
    """``compare``'s requests for ``policy``: under the logprob-close rule (bf16) it asks every policy for top
    logprobs (``equivalence.with_logprobs``); a peer that returns none gets copies without that ask and is judged on
    its tokens."""
    if rule == "exact" or "logprobs" not in UNSUPPORTED.get(policy, ()):
        return requests
    return [dataclasses.replace(r.copy(), sampling=dataclasses.replace(r.sampling, logprobs=None)) for r in requests]


def check_trace_policies(requests: list[Request], policies) -> None:
    """Raise ValueError, before any run, for a request that one of ``policies`` would refuse partway through a
    comparison: sampling a peer engine does not apply (``baselines.shared.UNSUPPORTED``), ``num_speculative_tokens``
    for a policy that does not speculate, ``num_external_computed_tokens`` for a scheduler that cannot receive KV."""
    from minibatch.policies import POLICIES

    for policy in policies:
        spec = POLICIES.get(policy)
        for r in requests:
            if spec is None and (field := unsupported_sampling(r, policy)):
                why = f"sets sampling {field}, which {policy} does not apply"
            elif spec is not None and r.num_speculative_tokens is not None and not spec.proposer:
                why = f"sets num_speculative_tokens, but {policy} does not speculate"
            elif spec is not None and r.num_external_computed_tokens and not getattr(spec.scheduler,
                                                                                      "receives_external_kv", False):
                why = f"sets num_external_computed_tokens, but {policy}'s scheduler cannot receive KV"
            else:
                continue
            raise ValueError(f"--trace: request {r.request_id!r} {why}: leave {policy} out of --policies")


def batch_sampling(requests: list[Request]) -> SamplingParams | None:
    """The one sampling setting HF can apply to a whole batch: the first sampled request's (None = greedy)."""
    return next((r.sampling for r in requests if not r.sampling.is_greedy), None)


def finish_request(r: Request, tokens: list[int], times: list[float], eos: tuple[int, ...]) -> None:
    """Fill ``r`` from its raw generated tokens and their times (s on the run's timeline): cut at its own EOS
    (``eos``, unless ``ignore_eos``) or max_new_tokens; sets num_computed_tokens and finish_time_s.

    Raises:
        RuntimeError: the tokens end before EOS or max_new_tokens (HF lost some).
    """
    if not r.sampling.ignore_eos:
        r.eos_token_ids = eos
    for tok, t in zip(tokens, times):
        r.append_token(tok)  # sets finish_reason / status at EOS (unless ignore_eos) or max_new_tokens
        r.token_times_s.append(t)
        if r.is_finished:
            break
    if not r.is_finished:
        raise RuntimeError(
            f"request {r.request_id!r}: HF returned {len(r.output_token_ids)} tokens, neither EOS nor "
            f"max_new_tokens ({r.max_new_tokens})"
        )
    # KV computed: the prompt, then one token per decode step (the last sampled token is never fed back)
    r.num_computed_tokens = r.num_prompt_tokens + r.num_output_tokens - 1
    r.finish_time_s = r.token_times_s[-1]


def progress_bar(progress: bool, total: int, desc: str):
    """A tqdm bar over ``total`` requests labelled ``desc``, or None when ``progress`` is off."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False)
