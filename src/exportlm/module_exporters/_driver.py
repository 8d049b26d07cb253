"""``export_quantized_state``: walk a model and stream its checkpoint tensors into a sink."""

from __future__ import annotations

import logging

import torch
from torch import nn

from exportlm.errors import UnclaimedModuleError
from exportlm.module_exporters._context import (
    ExportContext,
    ExportFormat,
    QuantExportSummary,
    TensorSink,
)
from exportlm.module_exporters._default import (
    EXPORT_MODULE_REGISTRY,
    ensure_module_exporters_registered,
)
from exportlm.module_exporters._registry import ExportModuleRegistry
from exportlm.module_exporters._ties import tie_book
from exportlm.quant import TensorQuantizer, is_quantized_module
from exportlm.quant.formats import DEFAULT_LAYOUT, checkpoint_layout

__all__ = ["checkpoint_bytes_at_least", "export_quantized_state"]

_PLAIN = (torch.Tensor, nn.Parameter)

logger = logging.getLogger(__name__)


def export_quantized_state(
    model: nn.Module,
    sink: TensorSink,
    *,
    format: ExportFormat = DEFAULT_LAYOUT,
    dtype: torch.dtype | None = None,
    is_qlora: bool = False,
    registry: ExportModuleRegistry | None = None,
) -> QuantExportSummary:
    """Write ``model``'s checkpoint tensors into ``sink``, one module at a time.

    Each quantized module is exported by exactly one exporter of ``registry``
    (default: :data:`EXPORT_MODULE_REGISTRY` with built-ins and plugins); every
    other parameter and persistent buffer (what ``model.state_dict()`` holds) is
    written as is (in ``dtype`` when given). Tied weights are written once, under
    the source name (``model.embed_tokens.weight``; ``lm_head.weight`` is absent
    and listed in the summary's ``tied_weights``), also when both tied modules are
    quantized alike. The model is not modified.

    Args:
        model: a (fake-)quantized or plain model.
        sink: anything with ``add(name, tensor)``; it receives checkpoint names.
        format: the checkpoint layout, a name of
            :data:`~exportlm.quant.formats.CHECKPOINT_LAYOUTS` (default: ModelOpt's).
        dtype: dtype of the unquantized floating tensors (default: keep).
        is_qlora: drop LoRA adapter tensors and write ``x.base_layer.weight`` as
            ``x.weight``; the summary names what was written, under those names.
        registry: the module-exporter registry to dispatch with.

    Raises:
        UnclaimedModuleError: a quantized module no exporter claims.
        TiedWeightsError: tensors declared tied hold different values, only one
            module of a tie is quantized, or two tied quantized copies differ.
        QuantizationError: a NaN / inf amax, or a never-calibrated quantizer.
    """
    checkpoint_layout(format)  # ValueError for an unknown layout, before any work
    if registry is None:
        ensure_module_exporters_registered()
        registry = EXPORT_MODULE_REGISTRY
    ctx = ExportContext(
        model=model, sink=sink, dtype=dtype, is_qlora=is_qlora, format=format, ties=tie_book(model)
    )
    modules = list(model.named_modules())
    for name, module in modules:
        exporter = registry.match(module)
        if exporter is not None:
            exporter.prepare_moe_inputs(name, module, ctx)
    # A buffer is written when a checkpoint of the model holds it: state_dict() is
    # the public definition of that (a buffer registered persistent=False is not in it).
    _walk(modules, registry, ctx, set(model.state_dict(keep_vars=True)))
    return ctx.summary()


def _walk(
    modules: list[tuple[str, nn.Module]],
    registry: ExportModuleRegistry,
    ctx: ExportContext,
    persistent: set[str],
) -> None:
    """Export every module: quantized ones (and their subtrees) by their exporter."""
    owned: str | None = None  # prefix of the quantized module whose subtree was exported
    for name, module in modules:
        if owned is not None and (name == owned or name.startswith(owned + ".")):
            continue
        owned = None
        if isinstance(module, TensorQuantizer):
            continue  # calibration state of a quantizer whose owner is not quantized
        if is_quantized_module(module):
            exporter = registry.match(module)
            if exporter is None:
                raise UnclaimedModuleError(_unclaimed_message(name, module, registry))
            with ctx.exporting(exporter, name, module):
                exporter.export(name, module, ctx)
            owned = name
            continue
        _emit_own_tensors(name, module, ctx, persistent)
        exporter = registry.match(module)
        if exporter is not None and exporter.exports_unquantized:
            with ctx.exporting(exporter, name, module):
                exporter.export(name, module, ctx)
        # Unquantized linear-like modules and embeddings are listed as excluded,
        # as ModelOpt lists them (lm_head, routers, embed_tokens).
        if _is_linear_like(module) or isinstance(module, nn.Embedding):
            ctx.quant_config.exclude(name)


def _unclaimed_message(name: str, module: nn.Module, registry: ExportModuleRegistry) -> str:
    names = ", ".join(e.describe() for e in registry.entries()) or "(none)"
    return (
        f"quantized module {name!r} ({type(module).__module__}.{type(module).__qualname__}) is "
        f"not claimed by any module exporter; registered: {names}. Register a ModuleExporter "
        "for it (EXPORT_MODULE_REGISTRY.register(...) or the 'exportlm.module_exporters' "
        "entry-point group), or leave the module unquantized."
    )


def _is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear``, or a router-like module with a 2-D ``weight`` (not an embedding)."""
    if isinstance(module, nn.Linear):
        return True
    weight = dict(module.named_parameters(recurse=False)).get("weight")
    return weight is not None and weight.dim() == 2 and not isinstance(module, nn.Embedding)


def _emit_own_tensors(
    name: str, module: nn.Module, ctx: ExportContext, persistent: set[str]
) -> None:
    """``module``'s own parameters and persistent buffers (not its children's, not ties)."""
    prefix = f"{name}." if name else ""
    for pname, param in module.named_parameters(recurse=False, remove_duplicate=False):
        if not ctx.ties.drops(prefix + pname):
            ctx.emit_plain(prefix + pname, param)
    for bname, buf in module.named_buffers(recurse=False, remove_duplicate=False):
        if prefix + bname in persistent and not ctx.ties.drops(prefix + bname):
            ctx.emit_plain(prefix + bname, buf)


def checkpoint_bytes_at_least(
    model: nn.Module, *, dtype: torch.dtype | None = None, is_qlora: bool = False
) -> int:
    """About the fewest bytes :func:`export_quantized_state` writes for ``model``: every
    parameter and persistent buffer outside the quantized modules (the embeddings, the
    norms, an unquantized ``lm_head``) as it writes them (in ``dtype`` where it casts), each
    tensor's memory counted once (a tie), and each quantized module's weight at its format's
    stored bytes an element (the weight leaf's dtype over the format's packing: FP8 and INT8
    one byte, INT4 and NVFP4 half a byte; half a byte where the quantizer does not name a
    registered format); scales are not counted.

    A hint for a writer that allocates its file ahead (the whole shard while the exporter
    converts, none of it left to after the conversion); computed without reading any
    weight. ``0`` with ``is_qlora`` (the adapters are dropped).
    """
    if is_qlora:
        return 0
    persistent = set(model.state_dict(keep_vars=True))
    seen: set[int] = set()
    tensors: list[torch.Tensor]
    total, owned = 0, None
    for name, module in model.named_modules():
        if (owned is not None and name.startswith(owned)) or isinstance(module, TensorQuantizer):
            continue
        prefix = f"{name}." if name else ""
        if is_quantized_module(module):
            owned = prefix  # its subtree is its exporter's
            weight = getattr(module, "weight", None)
            tensors = [weight] if isinstance(weight, torch.Tensor) else []
            per_element = _stored_bytes_per_element(module)
        else:
            tensors = [t for _, t in module.named_parameters(recurse=False)]
            tensors += [
                t for n, t in module.named_buffers(recurse=False) if prefix + n in persistent
            ]
        for tensor in tensors:  # plain tensors only (a subclass may not hold its bytes)
            if type(tensor) not in _PLAIN or tensor.is_meta or tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            cast = dtype is not None and tensor.is_floating_point()
            size = dtype.itemsize if dtype is not None and cast else tensor.element_size()
            total += int(tensor.numel() * per_element) if owned == prefix else tensor.numel() * size
    return total


def _stored_bytes_per_element(module: nn.Module) -> float:
    """Bytes an element of ``module``'s quantized weight as its format stores the codes
    (the weight leaf's dtype over the format's packing); half a byte (no built-in format
    stores fewer than 4 bits) where the quantizer or its format does not say."""
    quantizer = getattr(module, "weight_quantizer", None)
    if not isinstance(quantizer, TensorQuantizer) or not quantizer.enabled:
        return 0.5
    try:
        spec = quantizer.spec
    except ValueError:  # a format no longer registered: the hint stays at its floor
        return 0.5
    data = [leaf for leaf in spec.leaves if leaf.source == "data"]
    if not data or spec.packing < 1:
        return 0.5
    return data[0].dtype.itemsize / spec.packing
