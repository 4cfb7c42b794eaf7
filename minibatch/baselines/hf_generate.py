"""Baseline 1: HF ``model.generate`` on left-padded *static* batches, on a virtual wall-clock timeline.

Batches form by the same rule as our :class:`~minibatch.scheduler.static.StaticScheduler`; time advances by
the measured duration of each ``generate`` call and jumps over idle gaps (nothing is slept through), so the
run takes only as long as the compute. See :func:`run_hf_generate` and the ``minibatch.baselines`` overview.
"""

from __future__ import annotations

import time

import torch

from minibatch.baselines.generation_config import plain_generation, plain_generation_config
from minibatch.baselines.shared import batch_sampling, check_requests, finish_request, max_model_len, progress_bar
from minibatch.models import attention_implementation, eos_token_ids, pad_token_id
from minibatch.request import Request, RequestStatus


def _fitting_batch(candidates: list[Request], max_len: int | None) -> list[Request]:
    """The longest FCFS prefix of ``candidates`` that fits the model's positions as one padded batch.

    HF ``generate`` advances every row's position on every step, finished rows too, so the row with
    the longest prompt reaches position longest prompt + steps - 1, and a batch runs up to its
    longest max_new_tokens steps: it fits when longest prompt + longest max_new_tokens <= max_len
    (``max_len`` None: no limit). Every request fits alone (``check_requests``), so the prefix has
    at least one.
    """
    longest_prompt = longest_new = 0
    for n, r in enumerate(candidates):
        longest_prompt, longest_new = max(longest_prompt, r.num_prompt_tokens), max(longest_new, r.max_new_tokens)
        if n and max_len is not None and longest_prompt + longest_new > max_len:
            return candidates[:n]
    return candidates


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StepRecorder:
    """A ``StoppingCriteria`` that stamps every generation step and stops each row on its own terms.

    HF calls stopping criteria once per step, after the step's token is appended to ``input_ids``
    (the first call ends the prefill). We read the new tokens (a device sync on CUDA, so the stamp is
    taken once the step's work is done), record ``time.perf_counter()``, and mark a row done at its
    own EOS (unless ``ignore_eos``) or its own ``max_new_tokens``: generation stops when every row is
    done, exactly like a static batch; done rows keep computing until then (the honest static cost).
    """

    def __init__(self, requests: list[Request], eos: tuple[int, ...]):
        self.requests = requests
        self.eos = set(eos)
        self.times: list[float] = []
        self.done = [False] * len(requests)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        last = input_ids[:, -1].tolist()  # syncs with the device
        self.times.append(time.perf_counter())
        step = len(self.times)
        for i, (r, tok) in enumerate(zip(self.requests, last)):
            if not self.done[i]:
                self.done[i] = step >= r.max_new_tokens or (not r.sampling.ignore_eos and tok in self.eos)
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)


def _make_stopping_criteria(requests: list[Request], eos: tuple[int, ...]):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepRecorder(_StepRecorder, StoppingCriteria):
        pass

    recorder = StepRecorder(requests, eos)
    return recorder, StoppingCriteriaList([recorder])


def _generate_static_batch(model, batch: list[Request], start_s: float, eos: tuple[int, ...], pad_id: int) -> float:
    """One padded ``model.generate`` call; stamps ``batch`` on the timeline from ``start_s``; returns its duration."""
    device = model.device
    recorder, criteria = _make_stopping_criteria(batch, eos)
    sampling = batch_sampling(batch)  # one setting for the batch (see the module docstring)
    # EOS is handled per row by `recorder` (a row with ignore_eos must not stop at EOS): no EOS in the config
    gen_config = plain_generation_config(model, max(r.max_new_tokens for r in batch), sampling,
                                         eos_token_id=None, pad_token_id=pad_id)
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices, enabled=sampling is not None):
        if sampling is not None and sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        _sync(device)
        t0 = time.perf_counter()
        max_len = max(r.num_prompt_tokens for r in batch)
        ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), max_len), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every row's last token is real
            ids[i, max_len - r.num_prompt_tokens:] = torch.tensor(r.prompt_token_ids)
            mask[i, max_len - r.num_prompt_tokens:] = 1
        with plain_generation(model, gen_config):
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 generation_config=gen_config, stopping_criteria=criteria)
        generated = out[:, max_len:].tolist()
        _sync(device)
        duration = time.perf_counter() - t0
    times = [start_s + (t - t0) for t in recorder.times]
    if any(len(row) != len(times) for row in generated):
        raise RuntimeError(f"HF generate returned {len(generated[0])} tokens for {len(times)} recorded steps")
    for r, row in zip(batch, generated):
        r.first_scheduled_time_s = start_s
        finish_request(r, row, times, eos)
    return duration


def run_hf_generate(model, requests: list[Request], batch_size: int = 8, max_wait_s: float = 1.0,
                    progress: bool = False) -> list[Request]:
    """HF ``model.generate`` on padded static batches, measured on a virtual wall-clock timeline.

    Batches form as in our ``StaticScheduler``: requests queue FCFS by arrival; a batch of up to
    ``batch_size`` starts once ``batch_size`` have arrived or the oldest has waited ``max_wait_s``, and
    only after the previous ``generate`` returned. A batch also ends before the first request that
    would take it past the model's positions (see :func:`_fitting_batch`), which then heads the next
    batch. Prompts are left-padded (with an attention mask)
    and the batch generates ``max(max_new_tokens)`` steps unless every row finished earlier; each
    request keeps only its own tokens (cut at its EOS unless ``ignore_eos``, or its ``max_new_tokens``)
    and finishes at its own last token while the rest of the batch keeps computing.

    Time: ``now`` starts at 0, advances by each ``generate`` call's measured duration and jumps over
    idle gaps to the next arrival or batch wake time. The k-th token of every row is stamped with the
    end of generation step k (step 1 is the prefill), mapped onto that timeline.

    The model runs with transformers' SDPA attention during the call (the previous implementation is
    restored after) under ``torch.inference_mode``. Sampling: see the module docstring.

    Args:
        model: an HF causal LM (any device/dtype).
        requests: fresh requests (``request.copy()``) with unique ids; filled in place.
        batch_size: the most requests in one batch, >= 1.
        max_wait_s: start a partial batch once the oldest waiting request waited this long, >= 0.
        progress: show a tqdm bar over finished requests.

    Returns:
        ``requests``, same order, with outputs and time stamps.

    Raises:
        ValueError: empty input, duplicate ids, a request that already ran or is longer than the
            model's context, one that sets a sampling field generate does not apply (min_tokens, logprobs:
            ``baselines.shared.UNSUPPORTED``), batch_size < 1, or max_wait_s < 0 or NaN.
        RuntimeError: generate returned another number of tokens than the steps recorded, or a row's
            tokens end before its EOS or max_new_tokens (``baselines.shared.finish_request``).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not max_wait_s >= 0:
        raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
    check_requests(model, requests, "hf_generate")
    eos, pad_id, max_len = eos_token_ids(model), pad_token_id(model), max_model_len(model)
    pending = sorted(requests, key=lambda r: r.arrival_time_s)  # stable: ties keep input order (FCFS)
    bar = progress_bar(progress, len(requests), "hf-generate")
    now, nxt = 0.0, 0  # virtual clock; pending[nxt:] have not been admitted yet
    waiting: list[Request] = []
    with attention_implementation(model, "sdpa"), torch.inference_mode():
        while waiting or nxt < len(pending):
            while nxt < len(pending) and pending[nxt].arrival_time_s <= now:
                waiting.append(pending[nxt])
                nxt += 1
            if not waiting:
                now = pending[nxt].arrival_time_s  # idle: jump to the next arrival
                continue
            wake_s = waiting[0].arrival_time_s + max_wait_s
            if len(waiting) < batch_size and now < wake_s:  # wait for a fuller batch (or the wake time)
                now = min(wake_s, pending[nxt].arrival_time_s) if nxt < len(pending) else wake_s
                continue
            batch = _fitting_batch(waiting[:batch_size], max_len)
            waiting = waiting[len(batch):]
            for r in batch:
                r.status = RequestStatus.RUNNING
            now += _generate_static_batch(model, batch, now, eos, pad_id)
            if bar is not None:
                bar.update(len(batch))
    if bar is not None:
        bar.close()
    return requests
