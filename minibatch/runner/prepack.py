"""Linear layers made faster for a CPU's decode steps, with bit-identical outputs: bf16 weights laid out once for
oneDNN instead of at every call, sibling projections run as one product, and float32 products split across the
CPU's threads.

``torch.nn.functional.linear`` on a CPU in bfloat16 runs oneDNN's matmul and first reorders the weight into the
blocked layout oneDNN computes in, at every call. :func:`prepack_linears` does that reorder once per layer, at
load (``torch.ops.mkldnn._reorder_linear_weight``, the weight prepacking inductor applies when it freezes a model
and IPEX does at ``ipex.optimize``), and runs each layer with ``torch.ops.mkldnn._linear_pointwise``: the same
oneDNN kernel on the same numbers, so outputs are bit-identical (``tests/test_prepack.py``), only faster for the
small row counts of decode steps. The modules keep their names, parameters and checkpoint; only ``forward`` changes.

Sibling projections that read the same input are also run as one matrix product, as vLLM's model code does with
its merged ``qkv_proj`` and ``gate_up_proj`` weights: q/k/v_proj of an attention module and gate/up_proj of an MLP
(:data:`FUSED_GROUPS`) get one weight, their rows concatenated and prepacked once at load. The model's own forward
still calls each projection: the first call computes all of them and keeps the others' columns for their calls
on the same input tensor; a call on any other input computes its own. Fewer, larger products cost less (one pass
over the input, one oneDNN call instead of three): on SmolLM2-135M, 2-core CPU, the model's linears take 1.11x /
1.15x / 1.08x less time on 1 / 8 / 32 rows and whole decode steps are 1.10x / 1.08x / 1.05x as fast
(``benchmarks/fused_projections.py``, ``data/cpu/fused_projections.json``), with outputs still bit-identical
(oneDNN sums every output column over the same inputs in the same order, whatever the number of columns).

In float32 (no reorder to save: MKL's GEMM takes the weight as it is) :func:`split_linears` splits each layer's
output features into one slice per thread for inputs of a few rows (:class:`SplitLinear`): MKL runs such products
on one core or divides them poorly. MKL's number for a slice is not always the whole product's, so every
(shape, rows, threads) is checked on its first call and split only if it matched.
"""

from __future__ import annotations

import torch

from minibatch.kernels import cpu_split_linear
from minibatch.kernels.cpu_split_linear import MIN_COLS


class PrepackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward uses the weight reordered once (``packed_weight``); see the module docstring."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.device.type != "cpu" or x.numel() == 0:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed_weight, self.bias, "none",
                                                 [], "")
        return out.reshape(*shape[:-1], out.shape[-1])


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedGroup:
    """Sibling projections run as one product (module docstring): ``packed``, their weights' rows concatenated
    (prepacked for oneDNN when ``prepacked``, else as is, for ``F.linear``); ``bias`` concatenated (or None);
    ``sizes``, each member's output features; ``kept``: the input of the last fused product and the members'
    columns not yet taken."""

    def __init__(self, members: list[torch.nn.Linear], batch_size_hint: int, prepacked: bool = True):
        weight = torch.cat([m.weight.detach() for m in members])
        self.prepacked = prepacked
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint) if prepacked else weight
        self.bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        self.sizes = [m.out_features for m in members]
        self.kept: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None

    def __call__(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if index == 0:  # the first member: all the products at once, the others kept for their calls
            flat = x.reshape(-1, x.shape[-1])
            out = (torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "") if self.prepacked
                   else torch.nn.functional.linear(flat, self.packed, self.bias)).reshape(*x.shape[:-1], -1)
            parts = out.split(self.sizes, dim=-1)
            self.kept = (x, dict(enumerate(parts[1:], start=1)))
            return parts[0]
        if self.kept is not None and self.kept[0] is x and index in self.kept[1]:
            part = self.kept[1].pop(index)
            if not self.kept[1]:
                self.kept = None  # every column taken: do not hold the input
            return part
        return None


class GroupedLinear(PrepackedLinear):
    """A member of a :class:`FusedGroup` (``group``, ``index``): its output comes from the group's product when
    the call's input is the one the group last computed for, else it is computed alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and x.device.type == "cpu" and x.numel() > 0:
            out = self.group(x, self.index)
            if out is not None:
                return out
        return torch.nn.functional.linear(x, self.weight, self.bias)


def fuse_siblings(model, batch_size_hint: int = 32, prepacked: bool = True) -> int:
    """Group every module's q/k/v_proj and gate/up_proj (:data:`FUSED_GROUPS`; all present, one input size, biases
    all or none) into a :class:`FusedGroup`; returns how many groups were made. ``prepacked``: the members are
    :class:`PrepackedLinear` (bf16, oneDNN); else plain ``nn.Linear`` (or already grouped: grouped again, which
    refreshes the group's weight after an edit) and the group runs ``F.linear``. The runner fuses only prepacked
    bf16 layers: in float32 (MKL's GEMM) one product per group is bit-identical but did not pay on a 2-core AMD EPYC
    without AVX-512 (decode steps 0.92x to 0.95x as fast on 1 / 8 / 32 requests, ``python
    benchmarks/fused_projections.py --dtype float32``, ``data/cpu/fused_projections_float32.json``)."""
    made = 0
    for module in model.modules():
        for names in FUSED_GROUPS:
            members = [getattr(module, n, None) for n in names]
            if not all(isinstance(m, PrepackedLinear) if prepacked else type(m) in (torch.nn.Linear, GroupedLinear)
                       for m in members):
                continue
            if len({m.in_features for m in members}) > 1 or len({m.bias is None for m in members}) > 1:
                continue
            group = FusedGroup(members, batch_size_hint, prepacked)
            for i, m in enumerate(members):
                m.__class__, m.group, m.index = GroupedLinear, group, i
                if hasattr(m, "packed_weight"):
                    del m.packed_weight  # the group's copy serves; a lone call (another input) runs F.linear
            made += 1
    return made


def retype_linears(model, cls: type) -> int:
    """Give every plain ``nn.Linear`` of ``model`` the class ``cls`` (a subclass that changes only ``forward``: the
    modules keep their names, parameters and checkpoint); returns how many changed."""
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = cls
            changed += 1
    return changed


def can_prepack(model) -> bool:
    """Whether :func:`prepack_linears` applies: a bf16 model on a CPU with oneDNN (mkldnn) bf16 support."""
    p = next(model.parameters())
    return (p.device.type == "cpu" and p.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@torch.no_grad()
def prepack_linears(model, batch_size_hint: int = 32, fuse: bool = True) -> int:
    """Turn every ``nn.Linear`` of ``model`` into a :class:`PrepackedLinear` (in place; idempotent) and, with
    ``fuse``, group the sibling projections (:func:`fuse_siblings`); returns how many Linears were changed.
    Nothing changes where :func:`can_prepack` is False. A weight changed afterwards (e.g. ``model.to(...)``) makes a
    layer fall back to ``F.linear`` only if its dtype or device changed: prepack again after editing weights in
    place."""
    if not can_prepack(model):
        return 0
    changed = retype_linears(model, PrepackedLinear)
    for module in model.modules():
        if isinstance(module, PrepackedLinear):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), batch_size_hint)
    if fuse:
        fuse_siblings(model, batch_size_hint)
    return changed


# ---------------------------------------------------------------------------------------------- float32: split
SPLIT_MAX_ROWS = 64  # inputs of more rows (prefills) run F.linear: MKL's own threading serves them
# (out_features, in_features, bias, rows, threads) -> whether the split equalled F.linear bit for bit here
_split_exact: dict[tuple, bool] = {}


class SplitLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward, for inputs of at most :data:`SPLIT_MAX_ROWS` rows on a CPU with two or more
    threads, splits its output features across the threads (``kernels/cpu_split_linear.cpp``: tensor parallelism's
    column-parallel linear, Megatron-LM §3, across one CPU's cores); other calls run ``F.linear``.

    Kept bit-identical to ``F.linear``: MKL's float32 product is not always the same number for a slice of the
    output as for the whole (on a 2-core AMD EPYC, 2 threads, 5 rows it differs in the last bit; MKL picks its code
    path by the shapes and the thread count), so the first call of each (layer shape, rows, thread count) computes
    both, returns ``F.linear``'s and uses the split for that key from then on only if the two were equal
    (:data:`_split_exact`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        threads = torch.get_num_threads()
        if (x.dtype != self.weight.dtype or x.device.type != "cpu" or not 0 < rows <= SPLIT_MAX_ROWS or threads < 2
                or self.out_features < 2 * MIN_COLS):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        key = (self.out_features, self.in_features, self.bias is not None, rows, threads)
        exact = _split_exact.get(key)
        if exact is False:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        x2d = x.reshape(rows, x.shape[-1])
        out = cpu_split_linear.split_linear(x2d, self.weight, self.bias)
        if exact is None:  # the first call of this key: answer with F.linear, keep whether the split matched it
            whole = torch.nn.functional.linear(x2d, self.weight, self.bias)
            _split_exact[key] = torch.equal(out, whole)
            out = whole
        return out.reshape(*x.shape[:-1], out.shape[-1])


def can_split(model) -> bool:
    """Whether :func:`split_linears` applies: a float32 model on a CPU, and the split kernel builds here."""
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.float32 and cpu_split_linear.available()


@torch.no_grad()
def split_linears(model) -> int:
    """Turn every ``nn.Linear`` of a float32 CPU model into a :class:`SplitLinear` (in place; idempotent); returns
    how many Linears were changed (0 where :func:`can_split` is False). Why: in a decode step's few rows MKL's
    float32 product runs on one core or splits its work poorly (``benchmarks/split_linear.py``,
    ``data/cpu/split_linear.json``)."""
    return retype_linears(model, SplitLinear) if can_split(model) else 0
