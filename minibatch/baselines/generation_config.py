"""A ``GenerationConfig`` that does only what our engine does, and a block that keeps the checkpoint's out.

The checkpoint's generation_config (repetition_penalty, no_repeat_ngram_size, suppress_tokens, sampling
defaults, ...) would change HF's tokens or work: :func:`plain_generation_config` builds a fresh config with
all of that off and :func:`plain_generation` swaps it in for the model's own while HF generates. Used by
both baselines and by ``reference.reference_outputs``.
"""

from __future__ import annotations

import contextlib

from minibatch.models import eos_token_ids, pad_token_id
from minibatch.request import SamplingParams


# GenerationConfig fields that change the tokens or the work, at the value that turns them off (fields
# present in transformers 5.17 and later). The rest (forced_bos_token_id, suppress_tokens, bad_words_ids,
# sequence_bias, min_new_tokens, min_p, stop_strings, watermarking_config, cache_implementation, ...) are
# off at None, which ``plain_generation`` keeps from being refilled from the checkpoint's generation_config.
NEUTRAL_GENERATION_FIELDS = dict(
    num_beams=1, num_return_sequences=1, min_length=0, repetition_penalty=1.0,
    encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, length_penalty=1.0,
    typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, remove_invalid_values=False, renormalize_logits=False,
    use_cache=True,
)


def plain_generation_config(model, max_new_tokens: int, sampling: SamplingParams | None = None, **overrides):
    """A fresh ``GenerationConfig`` doing only what our engine does, nothing from the checkpoint's.

    It carries ``max_new_tokens``; greedy (``sampling`` None or greedy: ``do_sample=False``) or
    ``do_sample=True`` with ``sampling``'s temperature, top_k (0 = off) and top_p; the model's EOS
    ids (``models.eos_token_ids``) unless ``sampling.ignore_eos`` (then None: no EOS stop); the
    model's ``pad_token_id``. Every other field that changes the tokens is off
    (``NEUTRAL_GENERATION_FIELDS``, the rest None). Pass it to ``generate`` inside
    :func:`plain_generation`, or to transformers' continuous batching (which reads it as is).

    Args:
        model: an HF causal LM (read for its EOS and pad ids only).
        max_new_tokens: tokens to generate, >= 1.
        sampling: the :class:`~minibatch.request.SamplingParams` to map (None: greedy, EOS on).
        overrides: GenerationConfig fields set last (e.g. ``eos_token_id=-1``).

    Raises:
        TypeError: an override that is not a GenerationConfig field.
    """
    from transformers import GenerationConfig

    unknown = sorted(k for k in overrides if not hasattr(GenerationConfig(), k))
    if unknown:
        raise TypeError(f"plain_generation_config: {unknown} are not GenerationConfig fields")
    fields = dict(NEUTRAL_GENERATION_FIELDS, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id(model))
    eos = eos_token_ids(model)
    fields["eos_token_id"] = None if (sampling is not None and sampling.ignore_eos) or not eos else list(eos)
    if sampling is None or sampling.is_greedy:
        fields["do_sample"] = False
    else:
        fields.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    fields.update(overrides)
    return GenerationConfig(**fields)


@contextlib.contextmanager
def plain_generation(model, generation_config):
    """``model.generation_config`` is ``generation_config`` inside the block (restored on exit, also on error).

    ``model.generate(..., generation_config=cfg)`` fills every field ``cfg`` leaves at None from
    ``model.generation_config`` (the checkpoint's generation_config.json), then from transformers'
    global defaults; for some fields (forced_bos_token_id, suppress_tokens, bad_words_ids, ...) None
    is the only value that turns them off, so a fresh config alone cannot keep them out. With the
    model's own config swapped for ``cfg`` nothing of the checkpoint's is left to fill in. Yields
    ``generation_config``. Not for a model that another thread generates with meanwhile.
    """
    saved = model.generation_config
    model.generation_config = generation_config
    try:
        yield generation_config
    finally:
        model.generation_config = saved
