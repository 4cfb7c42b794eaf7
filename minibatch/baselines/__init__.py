"""Outside baselines for ``python -m minibatch compare``: Hugging Face's own ways to serve a trace.

Both run the unmodified model on the wall clock and fill the same :class:`~minibatch.request.Request`
stamps our engine fills (``first_scheduled_time_s``, ``token_times_s``, ``finish_time_s``,
``output_token_ids``, ``finish_reason``), in seconds from the trace start, so ``minibatch.metrics``
reads them like any engine run (TTFT = ``token_times_s[0] - arrival_time_s``, ...).

* :func:`run_hf_generate`: ``model.generate`` on left-padded *static* batches, formed by the same rule
  as our :class:`~minibatch.scheduler.static.StaticScheduler`. Time is a virtual timeline like our
  ``WallClock``: it advances by the measured duration of each ``generate`` call and jumps over idle
  gaps (nothing is slept through), so the run takes only as long as the compute.
* :func:`run_hf_generate_batch`: transformers' own continuous batching (paged attention, a background
  generation thread), the peer of our iteration-level engines. It has no virtual clock: requests are
  submitted at their real arrival times, so it takes as long as the trace.

Both mutate the requests they are given (pass ``[r.copy() for r in reqs]`` to reuse a trace) and
return them in the same order. Neither drops a request: bad input raises ``ValueError``, a request
HF fails or loses raises ``RuntimeError`` naming it.

Both do only what our engine does: the checkpoint's generation_config (repetition_penalty,
no_repeat_ngram_size, suppress_tokens, sampling defaults, ...) is replaced by
:func:`plain_generation_config` inside :func:`plain_generation`, as in ``compare.reference_outputs``.

Limits of the HF APIs (documented, not hidden):

* one sampling setting per call: ``generate`` samples a whole batch with one temperature/top-k/top-p
  and the global torch RNG, so per-request ``seed`` cannot be honoured. We use the first sampled
  request's parameters for the batch (``run_hf_generate``) or the run (``run_hf_generate_batch``), seed
  the RNG with its seed inside ``torch.random.fork_rng`` (the caller's RNG stream is untouched), and a
  greedy request in a sampled batch is sampled too. Greedy-only traces are exact.
"""

from minibatch.baselines.generation_config import plain_generation, plain_generation_config
from minibatch.baselines.hf_batch import run_hf_generate_batch
from minibatch.baselines.hf_generate import run_hf_generate

__all__ = ["plain_generation", "plain_generation_config", "run_hf_generate", "run_hf_generate_batch"]
