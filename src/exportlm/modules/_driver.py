"""``export_quantized_state``: walk a model and stream its checkpoint tensors into a sink."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from exportlm.errors import TiedWeightsError, UnclaimedModuleError
from exportlm.modules._context import (
    EXPORT_FORMATS,
    ExportContext,
    ExportFormat,
    QuantExportSummary,
    TensorSink,
)
from exportlm.modules._registry import ExportModuleRegistry
from exportlm.quant import TensorQuantizer, is_quantized_module

__all__ = ["export_quantized_state", "resolve_tied_weights"]

logger = logging.getLogger(__name__)

_LORA_PREFIX = "lora_"


def export_quantized_state(
    model: nn.Module,
    sink: TensorSink,
    *,
    format: ExportFormat = "modelopt",
    dtype: torch.dtype | None = None,
    is_qlora: bool = False,
    registry: ExportModuleRegistry | None = None,
) -> QuantExportSummary:
    """Write ``model``'s checkpoint tensors into ``sink``, one module at a time.

    Each quantized module is exported by exactly one exporter of ``registry``
    (default: :data:`EXPORT_MODULE_REGISTRY` with built-ins and plugins); every
    other parameter and persistent buffer is written as is (in ``dtype`` when
    given). Tied weights are written once, under the source name
    (``model.embed_tokens.weight``; ``lm_head.weight`` is dropped). The model is
    not modified.

    Args:
        model: a (fake-)quantized or plain model.
        sink: anything with ``add(name, tensor)``.
        format: ``"modelopt"`` or ``"compressed-tensors"`` (FP8 only).
        dtype: dtype of the unquantized floating tensors (default: keep).
        is_qlora: drop LoRA adapter tensors and write ``x.base_layer.weight`` as ``x.weight``.
        registry: the module-exporter registry to dispatch with.

    Raises:
        UnclaimedModuleError: a quantized module no exporter claims.
        TiedWeightsError: tensors declared tied hold different values, or a tied
            tensor is quantized.
        QuantizationError: a NaN / inf amax, or a never-calibrated quantizer.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {format!r}")
    if registry is None:
        from exportlm.modules import EXPORT_MODULE_REGISTRY, ensure_module_exporters_registered

        ensure_module_exporters_registered()
        registry = EXPORT_MODULE_REGISTRY
    out: TensorSink = _QLoRASink(sink) if is_qlora else sink
    ctx = ExportContext(model=model, sink=out, dtype=dtype, is_qlora=is_qlora, format=format)
    modules = list(model.named_modules())
    dropped = resolve_tied_weights(model)
    _check_ties_unquantized(model, dropped)
    for name, module in modules:
        exporter = registry.match(module)
        if exporter is not None:
            exporter.prepare_moe_inputs(name, module, ctx)
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
            exporter.export(name, module, ctx)
            owned = name
            continue
        _emit_own_tensors(name, module, ctx, dropped)
        exporter = registry.match(module)
        if exporter is not None and exporter.exports_unquantized:
            exporter.export(name, module, ctx)
        # Unquantized linear-like modules and embeddings are listed as excluded,
        # as ModelOpt lists them (lm_head, routers, embed_tokens).
        linear_like = _is_linear_like(module) or isinstance(module, nn.Embedding)
        if linear_like and not (is_qlora and _LORA_PREFIX in name):
            ctx.quant_config.exclude(name)
    return ctx.quant_config.summary(ctx.written, ctx.num_bytes)


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
    weight = module._parameters.get("weight")
    return weight is not None and weight.dim() == 2 and not isinstance(module, nn.Embedding)


def _emit_own_tensors(
    name: str, module: nn.Module, ctx: ExportContext, dropped: Mapping[str, str]
) -> None:
    prefix = f"{name}." if name else ""
    for pname, param in module._parameters.items():
        full = prefix + pname
        if param is not None and full not in dropped:
            ctx.emit_plain(full, param)
    non_persistent = module._non_persistent_buffers_set
    for bname, buf in module._buffers.items():
        full = prefix + bname
        if buf is not None and bname not in non_persistent and full not in dropped:
            ctx.emit_plain(full, buf)


# -- tied weights ---------------------------------------------------------------
def _declared_ties(model: nn.Module) -> dict[str, str]:
    """``{target: source}`` ties the model declares (transformers v5 dict or v4 list)."""
    config = getattr(model, "config", None)
    for flag in ("tie_word_embeddings", "tie_embeddings"):
        value = getattr(config, flag, None)
        if value is False:
            return {}
    expanded = getattr(model, "all_tied_weights_keys", None)
    if isinstance(expanded, Mapping) and expanded:
        return {str(k): str(v) for k, v in expanded.items()}
    declared = getattr(model, "_tied_weights_keys", None)
    if isinstance(declared, Mapping):
        return {str(k): str(v) for k, v in declared.items()}
    if isinstance(declared, (list, tuple)):  # transformers v4: targets tied to the input embeddings
        getter = getattr(model, "get_input_embeddings", None)
        embeddings = getter() if callable(getter) else None
        source = _param_name(model, getattr(embeddings, "weight", None))
        if source is not None:
            return {str(t): source for t in declared if str(t) != source}
    return {}


def _param_name(model: nn.Module, param: object) -> str | None:
    if param is None:
        return None
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is param:
            return name
    return None


def _lookup(model: nn.Module, name: str) -> torch.Tensor | None:
    owner, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return None
    tensor: torch.Tensor | None = module._parameters.get(leaf)
    if tensor is None:
        tensor = module._buffers.get(leaf)
    return tensor


def resolve_tied_weights(model: nn.Module) -> dict[str, str]:
    """``{dropped name: kept name}`` for every tied tensor written once.

    Declared ties (``_tied_weights_keys`` / ``all_tied_weights_keys``, honoured
    only when the config ties embeddings) keep the source name, as
    ``save_pretrained`` does; undeclared sharing falls back to parameter
    *identity* (the same ``Parameter`` object under two names; the first name
    is kept). Storage addresses (``data_ptr``) are never compared: two distinct
    tensors that happen to share an address are both written.

    Raises :class:`TiedWeightsError` when declared-tied tensors differ.
    """
    dropped: dict[str, str] = {}
    for target, source in _declared_ties(model).items():
        a, b = _lookup(model, target), _lookup(model, source)
        if a is None or b is None:
            logger.debug("declared tie %s -> %s: a side is missing; ignored", target, source)
            continue
        if a is not b and not (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)):
            raise TiedWeightsError(_tie_diff_message(target, source, a, b))
        dropped[target] = source
    seen: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        kept = seen.setdefault(id(param), name)
        if kept != name and name not in dropped and kept not in dropped:
            dropped[name] = kept
    return dropped


def _tie_diff_message(target: str, source: str, a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        detail = f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    else:
        detail = f"max abs difference {(a.float() - b.float()).abs().max().item():.3g}"
    return (
        f"{target!r} is declared tied to {source!r} but they differ ({detail}); writing one "
        "copy would lose weights. Re-tie them (model.tie_weights()) or set "
        "config.tie_word_embeddings=False and drop the declaration."
    )


def _check_ties_unquantized(model: nn.Module, dropped: Mapping[str, str]) -> None:
    for target, source in dropped.items():
        for name in (target, source):
            owner = name.rpartition(".")[0]
            module = model.get_submodule(owner) if owner else model
            if is_quantized_module(module):
                raise TiedWeightsError(
                    f"{target!r} is tied to {source!r}, but {owner!r} is quantized: a quantized "
                    "tensor cannot stand for its unquantized tie. Exclude it from quantization "
                    f"(exclude=[{owner!r}]) or untie the weights."
                )


class _QLoRASink:
    """Drops LoRA adapter tensors and writes ``x.base_layer.y`` as ``x.y`` (ModelOpt QLoRA)."""

    def __init__(self, inner: TensorSink) -> None:
        self.inner = inner

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if any(part.startswith(_LORA_PREFIX) for part in name.split(".")):
            return
        self.inner.add(name.replace(".base_layer.", "."), tensor)
