"""``quantize``: convert a model's modules to quantized wrappers and calibrate them."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from exportlm.errors import QuantizationError, UnsupportedFormatError
from exportlm.inputs import infer_vocab_size, make_input_ids
from exportlm.quant._formats import QuantFormat
from exportlm.quant._modules import (
    QuantBMMExperts,
    QuantEmbedding,
    QuantExperts,
    QuantFusedExperts,
    QuantLinear,
    QuantModule,
    QuantMoELinear,
    is_fused_experts,
    quant_experts_class,
)
from exportlm.quant._quantizer import TensorQuantizer
from exportlm.quant._recipe import ALGORITHMS, Algorithm, QuantRecipe, RecipeLike

__all__ = ["iterable_expert_lists", "quantize", "unify_expert_input_amax", "wrap_module"]

logger = logging.getLogger(__name__)

#: AWQ-lite smoothing strength: ``s = act^alpha / w^(1 - alpha)``.
AWQ_ALPHA = 0.5
_AWQ_EPS = 1e-5


@dataclass
class _Conversion:
    name: str
    module: nn.Module
    algo: Algorithm | None
    kv: QuantFormat | None
    kind: str  # "linear" | "moe_linear" | "embedding" | "experts"


def quantize(
    model: nn.Module,
    recipe: RecipeLike,
    calibrate: Callable[[nn.Module], object] | None = None,
    *,
    exclude: Sequence[str] | None = None,
    inplace: bool = True,
) -> nn.Module:
    """Fake-quantize ``model`` following ``recipe``; returns the quantized model.

    Args:
        model: any ``nn.Module``; ``nn.Linear``, transformers-5 fused experts and
            (when an override names them) ``nn.Embedding`` are converted.
        recipe: ``"fp8"``, ``"nvfp4"``, ``"int4_awq"``, ``"int8_wo"``, optionally
            combined with ``"fp8_kv"`` (``"fp8+fp8_kv"`` or ``["fp8", "fp8_kv"]``),
            a mapping of module-name patterns to recipes for mixed precision
            (``{"*": "fp8", "*.mlp.*": "nvfp4"}``) or a :class:`QuantRecipe`.
            ``lm_head``, MoE routers and embeddings stay unquantized by default.
        calibrate: ``calibrate(model)`` runs the calibration forwards (max
            calibration of activations). Default: one forward on deterministic
            ``input_ids`` from :func:`exportlm.export.make_input_ids`.
        exclude: extra fnmatch patterns of module names never quantized.
        inplace: convert ``model`` itself (default) or a deep copy of it.

    After calibration, linears that read the same input inside one parent
    (``q/k/v_proj``, ``gate/up_proj``) share their input amax and per-tensor weight
    amax (what fused-QKV / fused-gate-up kernels need, as ModelOpt exports them),
    and the experts of one iterable MoE block share their input amax.

    Raises:
        UnknownNameError: an unknown recipe name.
        UnsupportedFormatError: a format a module's shape cannot take (e.g. NVFP4
            on an input dimension not divisible by 16); nothing is converted then.
        QuantizationError: an already quantized model, a non-finite amax, or an
            activation quantizer that calibration never reached.
    """
    plan = QuantRecipe.parse(recipe, exclude)
    if not inplace:
        model = copy.deepcopy(model)
    conversions = list(_plan(model, plan))
    for conversion in conversions:
        _check_shapes(conversion)
    for conversion in conversions:
        _convert(conversion)
    _init_weight_amax(model)
    groups = _calibrate(model, calibrate)
    _finish_awq(model, groups)
    _unify_groups(model, groups)
    for experts in iterable_expert_lists(model).values():
        for quantizer, amax in unify_expert_input_amax(experts).items():
            quantizer.amax = amax
    _check_calibrated(model)
    logger.info("quantized %d module(s) of %s", len(conversions), type(model).__name__)
    return model


def wrap_module(module: nn.Module, name: str = "") -> QuantModule:
    """Convert one module in place to its quantized wrapper, every quantizer disabled.

    ``module`` is an ``nn.Linear`` (-> :class:`QuantLinear`), ``nn.Embedding``
    (-> :class:`QuantEmbedding`) or transformers-5 fused / BMM experts (->
    ``Quant<Experts>``, a :class:`QuantFusedExperts` / :class:`QuantBMMExperts`).
    Disabled quantizers pass tensors through, so the wrapper computes what the
    module did (through the wrapper's forward); enable single quantizers with
    :meth:`TensorQuantizer.load_scale`. This is how a checkpoint runtime
    re-applies exported activation scales to weights it has already dequantized.
    ``name`` labels the quantizers in error messages.

    Raises:
        QuantizationError: ``module`` is already quantized.
        UnsupportedFormatError: ``module`` has no quantized wrapper.
    """
    where = name or type(module).__name__
    if isinstance(module, QuantModule):
        raise QuantizationError(f"{where} is already quantized ({type(module).__name__})")
    kind = _kind(where, module, {})
    if kind is None:
        raise UnsupportedFormatError(
            f"{where} ({type(module).__name__}) has no quantized wrapper; expected an "
            "nn.Linear or nn.Embedding without a custom forward, or transformers-5 fused experts"
        )
    _convert(_Conversion(name, module, None, None, kind))
    if not isinstance(module, QuantModule):  # pragma: no cover - _convert always swaps the class
        raise QuantizationError(f"{where}: conversion did not produce a quantized wrapper")
    return module


# -- planning -----------------------------------------------------------------
def _plan(model: nn.Module, recipe: QuantRecipe) -> Iterator[_Conversion]:
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if isinstance(module, QuantModule):
            raise QuantizationError(
                f"{name or type(model).__name__} is already quantized "
                f"({type(module).__name__}); quantize the original model, or pass "
                "inplace=False on an unquantized one"
            )
        kind = _kind(name, module, modules)
        if kind is None:
            continue
        algo_name = recipe.algo_for(name, default_applies=kind != "embedding")
        algo = ALGORITHMS[algo_name] if algo_name else None
        kv = recipe.kv_for(name) if kind == "linear" and _kv_role(name) else None
        if algo is not None or kv is not None:
            yield _Conversion(name, module, algo, kv, kind)


def _kind(name: str, module: nn.Module, modules: dict[str, nn.Module]) -> str | None:
    if is_fused_experts(module):
        return "experts"
    if isinstance(module, nn.Linear):
        if type(module).forward is not nn.Linear.forward:
            logger.warning(
                "%s: %s overrides forward; left unquantized", name, type(module).__name__
            )
            return None
        return "moe_linear" if _in_expert_list(name, modules) else "linear"
    if isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward:
        return "embedding"
    return None


def _in_expert_list(name: str, modules: dict[str, nn.Module]) -> bool:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "experts" and isinstance(modules.get(".".join(parts[: i + 1])), nn.ModuleList):
            return True
    return False


def iterable_expert_lists(model: nn.Module) -> dict[str, nn.ModuleList]:
    """``{name: experts}`` of every ``nn.ModuleList`` named ``experts`` holding MoE linears."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and name.rsplit(".", 1)[-1] == "experts"
        and any(isinstance(m, QuantMoELinear) for m in module.modules())
    }


def _kv_role(name: str) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    return {"k_proj": "k", "v_proj": "v"}.get(leaf)


def _weight_shape(conversion: _Conversion) -> tuple[int, ...]:
    module: Any = conversion.module
    if conversion.kind == "experts":
        return tuple(module.gate_up_proj.shape)
    return tuple(module.weight.shape)


def _in_dims(conversion: _Conversion) -> list[tuple[str, int, int]]:
    """(what, rows, input features) of each weight the algorithm quantizes."""
    module: Any = conversion.module
    if conversion.kind != "experts":
        rows, cols = module.weight.shape
        return [("weight", rows, cols)]
    transposed = bool(getattr(module, "is_transposed", False))
    dims = []
    for proj in ("gate_up_proj", "down_proj"):
        shape = getattr(module, proj).shape
        rows, cols = (shape[2], shape[1]) if transposed else (shape[1], shape[2])
        dims.append((proj, rows, cols))
    return dims


def _check_shapes(conversion: _Conversion) -> None:
    algo = conversion.algo
    if algo is None or not algo.weight_block:
        return
    for what, rows, cols in _in_dims(conversion):
        bad_rows = algo.weight is QuantFormat.INT4 and rows % 2
        if cols % algo.weight_block or bad_rows:
            need = f"input features divisible by {algo.weight_block}"
            if algo.weight is QuantFormat.INT4:
                need += " and an even number of output features"
            raise UnsupportedFormatError(
                f"module {conversion.name!r} ({type(conversion.module).__name__}): recipe "
                f"{algo.name!r} needs {need}, but {what} has shape {_weight_shape(conversion)} "
                f"({rows} out x {cols} in). Exclude it (exclude=[{conversion.name!r}]) or give "
                f"it another recipe ({{{conversion.name!r}: 'fp8'}})."
            )
    if conversion.kind == "experts" and (
        not getattr(conversion.module, "has_gate", True)
        or getattr(conversion.module, "has_post_expert_norm", False)
    ):
        raise UnsupportedFormatError(
            f"module {conversion.name!r} ({type(conversion.module).__name__}): only gated "
            "experts without a post-expert norm can be quantized; exclude it"
        )


# -- conversion ---------------------------------------------------------------
def _weight_quantizer(algo: Algorithm | None, label: str, per_expert: bool) -> TensorQuantizer:
    if algo is None:
        return TensorQuantizer(QuantFormat.FP8, enabled=False, label=label)
    axis = 0 if per_expert else algo.weight_axis
    return TensorQuantizer(algo.weight, axis=axis, block_size=algo.weight_block, label=label)


def _input_quantizer(algo: Algorithm | None, label: str) -> TensorQuantizer:
    if algo is None or algo.input is None:
        quantizer = TensorQuantizer(QuantFormat.FP8, enabled=False, label=label)
        quantizer.track_channels = bool(algo and algo.awq)
        return quantizer
    block = algo.weight_block if algo.input is QuantFormat.NVFP4 else None
    return TensorQuantizer(algo.input, block_size=block, label=label)


def _convert(c: _Conversion) -> None:
    module: Any = c.module
    algo = c.algo
    if c.kind == "experts":
        base = QuantBMMExperts if getattr(module, "is_transposed", False) else QuantFusedExperts
        module.__class__ = quant_experts_class(type(module), base)
        for proj in QuantExperts.PROJECTIONS:
            setattr(
                module,
                f"{proj}_weight_quantizer",
                _weight_quantizer(algo, f"{c.name}.{proj}_weight_quantizer", True),
            )
            setattr(
                module,
                f"{proj}_input_quantizer",
                _input_quantizer(algo, f"{c.name}.{proj}_input_quantizer"),
            )
    elif c.kind == "embedding":
        module.__class__ = QuantEmbedding
        module.weight_quantizer = _weight_quantizer(algo, f"{c.name}.weight_quantizer", False)
    else:
        module.__class__ = QuantMoELinear if c.kind == "moe_linear" else QuantLinear
        module.weight_quantizer = _weight_quantizer(algo, f"{c.name}.weight_quantizer", False)
        module.input_quantizer = _input_quantizer(algo, f"{c.name}.input_quantizer")
        output = TensorQuantizer(
            c.kv or QuantFormat.FP8,
            enabled=c.kv is not None,
            label=f"{c.name}.output_quantizer",
            min_scale=1.0,
        )
        output.kv_role = _kv_role(c.name) if c.kv is not None else None
        module.output_quantizer = output
    module.quant_algo = algo.quant_algo if algo else None
    module.group_size = algo.group_size if algo else None


def _weights(module: QuantModule) -> Iterator[tuple[TensorQuantizer, torch.Tensor]]:
    if isinstance(module, QuantExperts):
        for proj in module.PROJECTIONS:
            yield module.weight_quantizer_of(proj), module.effective_weight(proj)
    elif isinstance(module, QuantLinear):
        yield module.weight_quantizer, module.effective_weight()
    elif isinstance(module, QuantEmbedding):
        yield module.weight_quantizer, module.weight


def _init_weight_amax(model: nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantModule):
                for quantizer, weight in _weights(module):
                    if quantizer.enabled:
                        quantizer.reset_amax()
                        quantizer.collect(weight)


# -- calibration --------------------------------------------------------------
def _default_calibrate(model: nn.Module) -> None:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    model(make_input_ids(infer_vocab_size(model), device=device))


def _activation_quantizers(model: nn.Module) -> Iterator[TensorQuantizer]:
    for module in model.modules():
        if isinstance(module, QuantModule):
            for attr, quantizer in module.quantizers():
                if "weight_quantizer" not in attr and (
                    quantizer.enabled or quantizer.track_channels
                ):
                    yield quantizer


def _calibrate(
    model: nn.Module, calibrate: Callable[[nn.Module], object] | None
) -> list[list[QuantLinear]]:
    """Run calibration; returns groups of linears that read the same input in one parent."""
    quantizers = list(_activation_quantizers(model))
    seen: dict[tuple[str, int], list[QuantLinear]] = {}
    keep_alive: list[torch.Tensor] = []  # ids stay unique while the inputs are referenced
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            handles.append(module.register_forward_pre_hook(_group_hook(seen, keep_alive, parent)))
    # As ModelOpt's max calibration: every quantizer is transparent while the
    # statistics are collected, so activations downstream are full precision
    # (weight fake-quant during calibration would shift every later amax).
    calibrating = {id(q) for q in quantizers}
    paused = [
        m
        for m in model.modules()
        if isinstance(m, TensorQuantizer) and m.enabled and id(m) not in calibrating
    ]
    for quantizer in quantizers:
        quantizer.calibrating = True
    for quantizer in paused:
        quantizer.enabled = False
    try:
        with torch.no_grad():
            (calibrate or _default_calibrate)(model)
    finally:
        for quantizer in quantizers:
            quantizer.calibrating = False
        for quantizer in paused:
            quantizer.enabled = True
        for handle in handles:
            handle.remove()
        keep_alive.clear()
    groups: dict[tuple[int, ...], list[QuantLinear]] = {}
    for members in seen.values():
        if len(members) > 1:
            groups.setdefault(tuple(sorted(map(id, members))), members)
    return list(groups.values())


def _group_hook(
    seen: dict[tuple[str, int], list[QuantLinear]], keep_alive: list[torch.Tensor], parent: str
) -> Callable[[nn.Module, tuple[object, ...]], None]:
    def hook(module: nn.Module, args: tuple[object, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            keep_alive.append(args[0])
            members = seen.setdefault((parent, id(args[0])), [])
            if isinstance(module, QuantLinear) and module not in members:
                members.append(module)

    return hook


def _finish_awq(model: nn.Module, groups: list[list[QuantLinear]]) -> None:
    """Set AWQ ``pre_quant_scale`` (shared inside a fusion group) and re-derive weight amax."""
    grouped = {id(m): group for group in groups for m in group}
    done: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantLinear) and module.input_quantizer.track_channels:
                if id(module) in done:
                    continue
                members = grouped.get(id(module), [module])
                members = [m for m in members if m.input_quantizer.track_channels]
                weights = [m.weight for m in members]
                pqs = _awq_scale(members[0].input_quantizer, weights)
                for member in members:
                    member.input_quantizer.pre_quant_scale = pqs
                    done.add(id(member))
            elif isinstance(module, QuantExperts):
                for proj in module.PROJECTIONS:
                    quantizer = module.input_quantizer_of(proj)
                    if quantizer.track_channels:
                        weight = module.canonical_weight(proj)
                        quantizer.pre_quant_scale = _awq_scale(quantizer, [weight])
    _init_weight_amax(model)


def _awq_scale(quantizer: TensorQuantizer, weights: list[torch.Tensor]) -> torch.Tensor:
    """AWQ-lite ``pre_quant_scale = 1 / s``, ``s = act^a / w^(1-a)`` normalized (no search)."""
    w_col = torch.stack(
        [w.detach().abs().float().reshape(-1, w.shape[-1]).amax(dim=0) for w in weights]
    ).amax(dim=0)
    act = quantizer.channel_amax
    quantizer.channel_amax = None
    quantizer.amax = None  # a disabled (weight-only) input quantizer keeps no amax
    if act is None:
        return torch.ones_like(w_col)
    s = act.clamp(min=_AWQ_EPS) ** AWQ_ALPHA / w_col.clamp(min=_AWQ_EPS) ** (1 - AWQ_ALPHA)
    s = s / math.sqrt(float(s.max()) * float(s.min()))
    return (1.0 / s).to(torch.float32)


def _unify_groups(model: nn.Module, groups: list[list[QuantLinear]]) -> None:
    for group in groups:
        algos = {m.quant_algo for m in group}
        if len(algos) != 1 or None in algos:
            logger.debug("not fusing %d linears with algorithms %s", len(group), algos)
            continue
        for attr in ("input_quantizer", "weight_quantizer"):
            quantizers = [getattr(m, attr) for m in group]
            if not all(q.enabled and q.amax is not None and q.amax.dim() == 0 for q in quantizers):
                continue
            # Inputs are shared for FP8 and NVFP4; per-tensor weight amax only for NVFP4
            # (one weight_scale_2 per fused GEMM). FP8 keeps one weight_scale per layer,
            # as ModelOpt 0.47 writes it (tests/test_interop.py compares the bytes).
            shareable: tuple[QuantFormat, ...] = (QuantFormat.FP8, QuantFormat.NVFP4)
            if attr == "weight_quantizer":
                shareable = (QuantFormat.NVFP4,)
            if quantizers[0].format not in shareable:
                continue
            shared = torch.stack([q.amax for q in quantizers]).amax()
            for quantizer in quantizers:
                quantizer.amax = shared.clone()


def unify_expert_input_amax(experts: nn.ModuleList) -> dict[TensorQuantizer, torch.Tensor]:
    """The shared input amax of each projection across the experts of one block.

    Returns ``{input_quantizer: block max amax}`` for every enabled input quantizer
    of a :class:`QuantMoELinear` in ``experts`` (an expert that calibration never
    routed a token to gets the block's amax). Nothing is modified.
    """
    by_projection: dict[str, list[TensorQuantizer]] = {}
    for expert in experts:
        for name, module in expert.named_modules():
            if isinstance(module, QuantMoELinear) and module.input_quantizer.enabled:
                by_projection.setdefault(name, []).append(module.input_quantizer)
    result: dict[TensorQuantizer, torch.Tensor] = {}
    for quantizers in by_projection.values():
        amaxes = [q.amax for q in quantizers if q.amax is not None]
        if not amaxes:
            continue
        shared = torch.stack(amaxes).amax()
        for quantizer in quantizers:
            result[quantizer] = shared
    return result


def _check_calibrated(model: nn.Module) -> None:
    missing = [
        q.label
        for q in _activation_quantizers(model)
        if q.enabled and q.format in (QuantFormat.FP8, QuantFormat.NVFP4) and q.amax is None
    ]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise QuantizationError(
            f"calibration never reached {len(missing)} activation quantizer(s): {shown}. Pass a "
            "calibrate(model) function whose forwards run every quantized module, or exclude "
            "those modules."
        )
