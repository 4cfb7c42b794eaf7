"""Linear layers whose weights are laid out once for oneDNN, not at every call (CPU, bf16).

``torch.nn.functional.linear`` on a CPU in bfloat16 runs oneDNN's matmul and first reorders the weight into the
blocked layout oneDNN computes in, at every call. :func:`prepack_linears` does that reorder once per layer, at
load (``torch.ops.mkldnn._reorder_linear_weight``, the weight prepacking inductor applies when it freezes a model
and IPEX does at ``ipex.optimize``), and runs each layer with ``torch.ops.mkldnn._linear_pointwise``: the same
oneDNN kernel on the same numbers, so outputs are bit-identical (``tests/test_prepack.py``), only faster for the
small row counts of decode steps. The modules keep their names, parameters and checkpoint; only ``forward`` changes.
"""

from __future__ import annotations

import torch


class PrepackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward uses the weight reordered once (``packed_weight``); see the module docstring."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.device.type != "cpu" or x.numel() == 0:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed_weight, self.bias, "none",
                                                 [], "")
        return out.reshape(*shape[:-1], out.shape[-1])


def can_prepack(model) -> bool:
    """Whether :func:`prepack_linears` applies: a bf16 model on a CPU with oneDNN (mkldnn) bf16 support."""
    p = next(model.parameters())
    return (p.device.type == "cpu" and p.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@torch.no_grad()
def prepack_linears(model, batch_size_hint: int = 32) -> int:
    """Turn every ``nn.Linear`` of ``model`` into a :class:`PrepackedLinear` (in place; idempotent); returns how
    many were changed. Nothing changes where :func:`can_prepack` is False. A weight changed afterwards (e.g.
    ``model.to(...)``) makes a layer fall back to ``F.linear`` only if its dtype or device changed: prepack
    again after editing weights in place."""
    if not can_prepack(model):
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = PrepackedLinear
            changed += 1
        if isinstance(module, PrepackedLinear):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), batch_size_hint)
    return changed
