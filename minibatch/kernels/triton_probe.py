"""Can Triton kernels run here, and how: compiled for the GPU or interpreted on the CPU (see
``minibatch.kernels``' docstring for why TRITON_INTERPRET must be set before triton is imported)."""

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

# Whether our kernels are interpreted, decided before they are decorated (their modules import this one first).
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
