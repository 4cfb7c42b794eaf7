"""What every model loader shares: the on-disk cache root, quiet Hugging Face loading, ``from_pretrained``.

:func:`cache_dir` is where converted models (``minibatch.gguf``), cached reference outputs and draft
training data live; :func:`quiet_loading` keeps transformers' (and the hub client's) logging and
progress bars out of notebooks while a model loads; :func:`load_pretrained` loads a model with its
tokenizer that way.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # transformers is imported where a model is loaded: `import minibatch` stays light
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def cache_dir() -> Path:
    """Root of the converted-model cache: ``$MINIBATCH_CACHE`` or ``~/.cache/minibatch``."""
    return Path(os.environ.get("MINIBATCH_CACHE") or Path.home() / ".cache" / "minibatch")


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Silence transformers' logging and progress bars (restored on exit).

    Notebooks must show no stderr noise. The GGUF de-quantiser uses a bare
    ``tqdm`` that ignores ``disable_progress_bar()``, so we swap in a disabled one.
    """
    from huggingface_hub.utils import logging as hub_logging
    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub_verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # the hub client's retry warnings when it is unreachable
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    old_tqdm, gguf_utils.tqdm = gguf_utils.tqdm, functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = old_tqdm
        hf_logging.set_verbosity(verbosity)
        hub_logging.set_verbosity(hub_verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_pretrained(name_or_path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` by ``from_pretrained`` from a local directory or a hub id, quietly.

    Raises what ``from_pretrained`` raises (OSError, ValueError, ...): callers word the message.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_loading():
        return AutoModelForCausalLM.from_pretrained(name_or_path), AutoTokenizer.from_pretrained(name_or_path)
