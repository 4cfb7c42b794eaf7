"""Attention backends: the ways to run one packed step's attention, each one class registered by name.

The packed attention function (``runner.attention``) checks what the model passes, then hands the step to the
backend named by the runner: ``prepare`` adds the backend's own metadata to the step's common
:class:`~minibatch.runner.attention.AttentionMetadata` (built once per step by ``runner.batch``), and ``forward``
writes the new tokens' K/V into the paged KV cache and attends. Built in: ``torch`` (the reference: gather K/V
by slot, scaled_dot_product_attention in fp32), ``triton`` (the paged-attention kernels of ``minibatch.kernels``),
``sdpa`` (K/V read by whole block, fused SDPA in the model's dtype: the fast eager path), ``compiled`` (sdpa
with a torch.compile'd decode kernel that reads K/V through the block table) and ``cpp`` (sdpa with a C++ decode
kernel reading K/V through the block table, CPU only).
Adding one is one file: subclass :class:`AttentionBackend`, call :func:`register_backend`, and pass its name as
``--attention-backend`` (a ``--policy-module`` file may register it). This is vLLM's attention-backend idea
(``vllm/attention/backends``: a backend class with its metadata builder), reduced to two methods.
"""

from minibatch.runner.backends.base import BACKENDS, AttentionBackend, backend_names, get_backend, register_backend
from minibatch.runner.backends import torch_ref, triton_paged, sdpa, compiled, cpp_paged  # built-ins, reference first

__all__ = ["BACKENDS", "AttentionBackend", "backend_names", "get_backend", "register_backend", "compiled",
           "cpp_paged", "sdpa", "torch_ref", "triton_paged"]
