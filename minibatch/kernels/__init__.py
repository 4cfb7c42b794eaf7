"""Triton kernels for the paged KV cache, each next to a pure-torch reference.

    store_kv / store_kv_ref                                 write new K/V into their cache slots
    paged_decode_attention / paged_decode_attention_ref     one query per sequence
    paged_prefill_attention / paged_prefill_attention_ref   packed causal queries, any q_len

Running without a GPU: Triton's interpreter (``TRITON_INTERPRET=1``) executes ``@triton.jit``
kernels in numpy on CPU tensors, so the kernels can be read, stepped through and tested on a
laptop. Triton reads the variable when ``@triton.jit`` *decorates* a function: in triton 3.x,
``jit()`` checks ``knobs.runtime.interpret`` (a fresh getenv on every read) and returns an
``InterpretedFunction`` instead of a ``JITFunction``. That includes triton.language's own helpers
(``tl.sum``, ``tl.max``, ``tl.zeros`` are ``@jit`` functions in ``triton/language/standard.py``),
which are decorated by ``import triton``. So the variable must be set before triton is first
imported *anywhere in the process*, not just before our kernels are decorated. Note that
``import transformers`` imports torch._dynamo, which imports triton: setting the variable here is
only early enough if nothing imported transformers (or triton) before minibatch.kernels, so the
package ``minibatch/__init__.py`` should do the same at its top. If it was set too late, the
kernels raise a RuntimeError that says so (``INTERPRETER_TOO_LATE``).

This file sets it when CUDA is not available; ``setdefault`` keeps a value the user chose. The
variable is process-wide: other libraries' ``@triton.jit`` functions are interpreted too.

If triton cannot be imported at all (it has no wheels for macOS or Windows), this package still
imports: the ``*_ref`` functions work and the Triton-backed ones raise RuntimeError.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401  (only probing that it imports)

    HAS_TRITON = True
    TRITON_IMPORT_ERROR = None
except (ImportError, OSError) as e:  # not installed, or a broken install (missing shared library)
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = e

# Whether our kernels are interpreted, decided now because they are decorated just below.
# Same spellings as triton's getenv_bool.
IS_INTERPRETED = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
# ... but triton.language's helpers were decorated at the first `import triton`, maybe before the
# variable was set (then the interpreter cannot call them).
INTERPRETER_TOO_LATE = False
if IS_INTERPRETED:
    from triton.runtime.interpreter import InterpretedFunction

    INTERPRETER_TOO_LATE = not isinstance(triton.language.zeros, InterpretedFunction)


def require_triton(device: torch.device) -> None:
    """Raise RuntimeError unless a Triton kernel can run on tensors on ``device``."""
    if not HAS_TRITON:
        raise RuntimeError(
            f"triton could not be imported ({TRITON_IMPORT_ERROR!r}); install it (Linux only) "
            "or use the *_ref functions in minibatch.kernels"
        )
    if device.type != "cuda" and not IS_INTERPRETED:
        raise RuntimeError(
            f"the kernels were compiled for the GPU, so they cannot run on {device.type} tensors; set "
            "TRITON_INTERPRET=1 before importing minibatch.kernels to run them in Triton's interpreter"
        )
    if INTERPRETER_TOO_LATE:
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set (transformers imports it through "
            "torch._dynamo), so triton.language's helpers cannot run in the interpreter; set "
            "TRITON_INTERPRET=1 in the environment, or before anything imports transformers or triton"
        )


# The kernel modules import HAS_TRITON and require_triton from this package, so they come after.
from minibatch.kernels.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from minibatch.kernels.store_kv import store_kv, store_kv_ref  # noqa: E402

__all__ = [
    "HAS_TRITON", "IS_INTERPRETED", "INTERPRETER_TOO_LATE", "require_triton",
    "store_kv", "store_kv_ref",
    "paged_decode_attention", "paged_decode_attention_ref",
    "paged_prefill_attention", "paged_prefill_attention_ref",
]
