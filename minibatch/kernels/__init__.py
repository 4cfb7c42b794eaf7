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

``triton_probe`` sets it when CUDA is not available; ``setdefault`` keeps a value the user chose. The
variable is process-wide: other libraries' ``@triton.jit`` functions are interpreted too.

bf16 and fp16 work both ways. The interpreter keeps bf16 as raw 16-bit integers and cannot do bf16
arithmetic, so interpreted kernels compute on fp32 copies of their tiles (see ``PREFILL_FP32_TILES``).

If triton cannot be imported at all (it has no wheels for macOS or Windows), this package still
imports: the ``*_ref`` functions work and the Triton-backed ones raise RuntimeError.
"""

from minibatch.kernels.triton_probe import (HAS_TRITON, INTERPRETER_TOO_LATE, IS_INTERPRETED,  # noqa: F401
                                            TRITON_IMPORT_ERROR, require_triton)
from minibatch.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from minibatch.kernels.store_kv import store_kv, store_kv_ref

__all__ = [
    "HAS_TRITON", "IS_INTERPRETED", "INTERPRETER_TOO_LATE", "require_triton",
    "store_kv", "store_kv_ref",
    "paged_decode_attention", "paged_decode_attention_ref",
    "paged_prefill_attention", "paged_prefill_attention_ref",
]
