"""Linear layers made faster for a CPU's decode steps: bf16 weights laid out once for oneDNN instead of at every
call and sibling projections run as one product (bit-identical outputs), and float32 weights packed once for our own
matrix-product kernel (the engine's steps only).

``torch.nn.functional.linear`` on a CPU in bfloat16 runs oneDNN's matmul and first reorders the weight into the
blocked layout oneDNN computes in, at every call. :func:`prepack_linears` does that reorder once per layer, at
load (``torch.ops.mkldnn._reorder_linear_weight``, the weight prepacking inductor applies when it freezes a model
and IPEX does at ``ipex.optimize``), and runs each layer with ``torch.ops.mkldnn._linear_pointwise``: the same
oneDNN kernel on the same numbers, so outputs are bit-identical (``tests/test_prepack.py``), only faster for the
small row counts of decode steps. The modules keep their names, parameters and checkpoint; only ``forward`` changes.
On CPUs with AMX, products of up to 32 rows run our AMX kernel on the same prepacked bytes instead
(:func:`prepacked_product`, ``kernels.cpu_amx_linear``: its layout checked at prepacking, its outputs oneDNN's bit
for bit on every shape tested, a fraction of oneDNN's per-call cost). On CPUs with AVX512-BF16 and no AMX, products
of up to 64 rows in the engine's own steps (:func:`engine_linears`) run our AVX512-BF16 kernel on the same bytes
(``kernels.cpu_bf16_linear``: its sums in order over k, oneDNN's in blocks, so about one output in 10^4 differs in
the last bit; outside the engine's steps the outputs stay F.linear's bit for bit).

Sibling projections that read the same input are also run as one matrix product, as vLLM's model code does with
its merged ``qkv_proj`` and ``gate_up_proj`` weights: q/k/v_proj of an attention module and gate/up_proj of an MLP
(:data:`FUSED_GROUPS`) get one weight, their rows concatenated and prepacked once at load. The model's own forward
still calls each projection: the first call computes all of them and keeps the others' columns for their calls
on the same input tensor; a call on any other input computes its own. Fewer, larger products cost less (one pass
over the input, one oneDNN call instead of three): on SmolLM2-135M, 2-core CPU, the model's linears take 1.11x /
1.15x / 1.08x less time on 1 / 8 / 32 rows and whole decode steps are 1.10x / 1.08x / 1.05x as fast
(``benchmarks/fused_projections.py``, ``data/cpu/fused_projections.json``), with outputs still bit-identical
(oneDNN sums every output column over the same inputs in the same order, whatever the number of columns).

In float32, ``F.linear`` calls MKL's GEMM, which takes the weight as it is, packs it again at every call and runs
the few rows of a decode step far below the CPU's peak. :func:`pack_linears` packs every weight once into panels for
``kernels.cpu_linear`` (GotoBLAS-style, :class:`PanelLinear`). Its float32 sums run in another order than MKL's, so
the outputs are not bit-identical to ``F.linear``: the layers use the kernel only inside :func:`engine_linears` (the
engine's own steps), and ``model.generate`` on the same model object (the Hugging Face reference, the transformers
baselines) still runs stock ``F.linear``.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from minibatch.kernels import cpu_amx_linear, cpu_bf16_linear, cpu_linear


class PrepackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward uses the weight reordered once (``packed_weight``); see the module docstring."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.device.type != "cpu" or x.numel() == 0:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        shape = x.shape
        out = prepacked_product(x.reshape(-1, shape[-1]), self.packed_weight, self.out_features, self.bias, self.amx,
                                self.bf16)
        return out.reshape(*shape[:-1], out.shape[-1])


def prepacked_product(flat: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                      amx: bool, bf16: bool) -> torch.Tensor:
    """``flat`` (rows, in_features) times a weight prepacked for oneDNN, plus ``bias``: on AMX
    (``kernels.cpu_amx_linear``, from the same prepacked bytes, oneDNN's outputs bit for bit) for at most
    ``AMX_MAX_ROWS`` rows where ``amx``; inside :func:`engine_linears` (the engine's own steps) with AVX512-BF16
    (``kernels.cpu_bf16_linear``, the same bytes, sums in another order than oneDNN's) for at most ``BF16_MAX_ROWS``
    rows where ``bf16``; else oneDNN's matmul. ``amx``, ``bf16``: the layout was checked at prepacking."""
    rows = flat.shape[0]
    if amx and rows <= cpu_amx_linear.AMX_MAX_ROWS:
        return cpu_amx_linear.amx_linear(flat, packed, out_features, bias)
    if bf16 and rows <= cpu_bf16_linear.BF16_MAX_ROWS and _IN_ENGINE.get():
        return cpu_bf16_linear.bf16_linear(flat, packed, out_features, bias)
    return torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# how many times this process has packed, prepacked or grouped layers (:func:`prepack_linears`, :func:`fuse_siblings`,
# :func:`pack_linears` each add one): a reader of the layers' packed weights (``runner.fused_layers.FusedDecoder``)
# reads them again when it changed
GENERATION = 0


def _new_generation() -> None:
    global GENERATION
    GENERATION += 1


class FusedGroup:
    """Sibling projections run as one product (module docstring): ``packed``, their weights' rows concatenated and
    laid out for ``layout`` ("onednn": prepacked for oneDNN, bf16; "panels": our float32 kernel's panels, which it
    runs only inside :func:`engine_linears`; "plain": as is, for ``F.linear``); ``bias`` concatenated (or None);
    ``sizes``, each member's output features; ``kept``: the input of the last fused product and the members'
    columns not yet taken."""

    def __init__(self, members: list[torch.nn.Linear], batch_size_hint: int, layout: str = "onednn"):
        weight = torch.cat([m.weight.detach() for m in members])
        self.layout = layout
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint) if layout == "onednn"
                       else cpu_linear.pack_weight(weight) if layout == "panels" else weight)
        self.amx = layout == "onednn" and cpu_amx_linear.layout_ok(self.packed, weight)  # prepacked_product's
        self.bf16 = layout == "onednn" and not self.amx and cpu_bf16_linear.layout_ok(self.packed, weight)
        self.bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        self.sizes = [m.out_features for m in members]
        self.kept: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None
        # panels: the members' weights and their versions when packed (an in-place edit since: F.linear, not stale)
        self.sources = [(m.weight, m.weight._version) for m in members] if layout == "panels" else []

    def product(self, flat: torch.Tensor) -> torch.Tensor | None:
        """All the members' outputs for ``flat`` (rows, in_features), or None where this layout does not run."""
        if self.layout == "onednn":
            return prepacked_product(flat, self.packed, sum(self.sizes), self.bias, self.amx, self.bf16)
        if self.layout == "panels":
            if not (_IN_ENGINE.get() and flat.dtype == torch.float32 and flat.shape[0] <= PANEL_MAX_ROWS
                    and all(w._version == v for w, v in self.sources)):
                return None
            return cpu_linear.packed_linear(flat, self.packed, sum(self.sizes), self.bias)
        return torch.nn.functional.linear(flat, self.packed, self.bias)

    def __call__(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if index == 0:  # the first member: all the products at once, the others kept for their calls
            out = self.product(x.reshape(-1, x.shape[-1]))
            if out is None:
                return None
            parts = out.reshape(*x.shape[:-1], -1).split(self.sizes, dim=-1)
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


def fuse_siblings(model, batch_size_hint: int = 32, layout: str = "onednn") -> int:
    """Group every module's q/k/v_proj and gate/up_proj (:data:`FUSED_GROUPS`; all present, one input size, biases
    all or none) into a :class:`FusedGroup`; returns how many groups were made. ``layout`` "onednn": the members are
    :class:`PrepackedLinear` (bf16); "panels": :class:`PanelLinear` (float32, our kernel); "plain": plain
    ``nn.Linear`` and the group runs ``F.linear`` (members already grouped are grouped again, which refreshes the
    group's weight after an edit). With MKL's GEMM (plain) one product per group is bit-identical but did not pay on
    a 2-core AMD EPYC without AVX-512 (decode steps 0.92x to 0.95x as fast on 1 / 8 / 32 requests, ``python
    benchmarks/fused_projections.py --dtype float32 --layout plain``, ``data/cpu/fused_projections_float32.json``).
    On our panels it is bit-identical too (the kernel computes each output feature alone) and did not pay either
    (:func:`pack_linears`)."""
    member_ok = {"onednn": lambda m: isinstance(m, PrepackedLinear),
                 "panels": lambda m: isinstance(m, PanelLinear),
                 "plain": lambda m: type(m) in (torch.nn.Linear, GroupedLinear)}[layout]
    made = 0
    for module in model.modules():
        for names in FUSED_GROUPS:
            members = [getattr(module, n, None) for n in names]
            if not all(member_ok(m) for m in members):
                continue
            if len({m.in_features for m in members}) > 1 or len({m.bias is None for m in members}) > 1:
                continue
            group = FusedGroup(members, batch_size_hint, layout)
            for i, m in enumerate(members):
                m.__class__, m.group, m.index = GroupedLinear, group, i
                for copy in ("packed_weight", "panels"):
                    if hasattr(m, copy):
                        delattr(m, copy)  # the group's copy serves; a lone call (another input) runs F.linear
            made += 1
    _new_generation()  # after the changes: a reader re-reads what they made
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
        fuse_siblings(model, batch_size_hint, "onednn")  # a group checks its own weight for AMX
    for module in model.modules():
        if type(module) is PrepackedLinear:  # left alone: its own weight, checked once
            module.amx = cpu_amx_linear.layout_ok(module.packed_weight, module.weight)
            module.bf16 = not module.amx and cpu_bf16_linear.layout_ok(module.packed_weight, module.weight)
    _new_generation()  # after the changes: a reader re-reads what they made
    return changed


# --------------------------------------------------------------------------------------------- float32: panels
PANEL_MAX_ROWS = 512  # inputs of more rows (long prefills) run F.linear: MKL's blocking for large products serves them
_IN_ENGINE: contextvars.ContextVar[bool] = contextvars.ContextVar("minibatch_engine_linears", default=False)


@contextlib.contextmanager
def engine_linears():
    """Inside this block (the engine's steps: ``ModelRunner.forward_packed`` and its padded forward) the model's
    :class:`PanelLinear` layers run the packed kernel; outside it (``model.generate``, the Hugging Face reference
    and baselines on the same model object) they run stock ``F.linear``."""
    token = _IN_ENGINE.set(True)
    try:
        yield
    finally:
        _IN_ENGINE.reset(token)


class PanelLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward, inside :func:`engine_linears` for float32 CPU inputs of at most
    :data:`PANEL_MAX_ROWS` rows, runs ``kernels.cpu_linear.packed_linear`` on ``panels`` (its weight packed once,
    GotoBLAS-style panels of 16 output features); every other call runs ``F.linear``. The outputs are float32 sums
    of the same products in another order (not bit-identical to ``F.linear``; for inputs up to PANEL_MAX_ROWS rows,
    the same whatever the batch); the engine's fp32 outputs stay token-exact with Hugging Face ``generate``
    (tests/test_smollm2_engine.py, test_golden.py). A weight changed in place after packing (``load_state_dict``, a
    merged adapter: its ``_version`` moves) makes the layer run ``F.linear`` until :func:`pack_linears` packs it
    again; ``packed_version`` is the weight's version the panels were packed from."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # cheap checks only: a decode step calls ~200 of these, so a few microseconds each add up
        if (_IN_ENGINE.get() and x.dtype == torch.float32 and x.is_cpu and x.numel() <= PANEL_MAX_ROWS * x.shape[-1]
                and self.weight._version == self.packed_version):
            return cpu_linear.packed_linear(x, self.panels, self.out_features, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)


def can_pack_panels(model) -> bool:
    """Whether :func:`pack_linears` applies: a float32 model on a CPU whose linear weights' second copy (the panels)
    takes at most half of the memory available now, and the kernel builds here."""
    import psutil

    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return False
    copy_bytes = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    return copy_bytes <= psutil.virtual_memory().available // 2 and cpu_linear.available()


@torch.no_grad()
def pack_linears(model, fuse: bool = False) -> int:
    """Turn every ``nn.Linear`` of a float32 CPU model into a :class:`PanelLinear`, its weight packed once into
    panels (in place; a layer packed or grouped before is packed again, which refreshes it after a weight edit) and,
    with ``fuse``, group the sibling projections (:func:`fuse_siblings`, "panels"; off by default: on a 2-core AMD
    EPYC it made decode steps 0.96x / 0.98x / 0.97x as fast on 1 / 8 / 32 requests, ``python
    benchmarks/fused_projections.py --dtype float32 --layout panels``, ``data/cpu/fused_panels.json``); returns how
    many Linears were packed (0 where :func:`can_pack_panels` is False: then layers packed or grouped before are
    plain ``nn.Linear`` again). The panels are a second copy of the
    weights (the model's own stay, for ``F.linear`` and the checkpoint). Why: MKL's float32 GEMM runs a decode step's
    few rows far below the CPU's peak (``benchmarks/cpu_linear.py``, ``data/cpu/cpu_linear.json``)."""
    ok = can_pack_panels(model)
    packed = 0
    for module in model.modules():
        layout = module.group.layout if type(module) is GroupedLinear else None
        ours = type(module) is PanelLinear or layout == "panels"  # packed or grouped on panels before
        if ours or (ok and (type(module) is torch.nn.Linear or layout == "plain")):
            for old in ("panels", "packed_version", "group", "index"):  # an earlier packing or grouping
                if hasattr(module, old):
                    delattr(module, old)
            module.__class__ = PanelLinear if ok else torch.nn.Linear  # refused: plain again, never stale panels
            if ok:
                module.panels = cpu_linear.pack_weight(module.weight.detach())
                module.packed_version = module.weight._version
                packed += 1
    if ok and fuse:
        fuse_siblings(model, layout="panels")
    _new_generation()  # after the changes: a reader re-reads what they made
    return packed
