"""SmoothQuant: move activation outliers into the weights, as ModelOpt's ``smoothquant``.

For every quantized linear whose recipe sets ``smoothquant_alpha`` (``int8_sq``):

1. calibration records the per-input-channel amax of its input (``act``) beside the
   per-tensor amax (the input quantizer's ``track_channels``);
2. ``s = max|W|_col ^ (1 - alpha) / act ^ alpha`` (``max|W|_col``: the amax of each
   input column of the weight), channels whose ``act`` is zero get ``s = 1``, and
   ``s`` is clamped to ``[1e-4, 1e4]`` (ModelOpt 0.47 ``model_calib.smoothquant``);
3. the input is multiplied by ``s`` (``pre_quant_scale``), the weight is stored
   divided by it (``W * (1 / s)``: the smoothed weight is the parameter, as ModelOpt
   keeps it) and the input amax becomes ``max(act * s)``;
4. linears that read one input (``q/k/v``, ``gate/up``) take the mean of their
   scales, each weight rescaled by ``old / mean`` (ModelOpt does this when it
   exports, ``preprocess_linear_fusion``; here it happens before the weights are
   quantized, so the fake-quantized model is what is exported).

A recipe with ``smoothquant_fold`` (``w8a8``) smooths as llm-compressor 0.14's
``SmoothQuantModifier`` does instead (``modifiers/transform/smoothquant/base.py``,
``_apply_smoothing`` / ``_calculate_smoothing_scales``): one scale per group of linears
that read one input, from the input's per-channel *dynamic range* ``r = max(x) - min(x)``
over the calibration tokens (signed: not ``max|x|``) and ``w = 2 * max|W|_col`` over the
group, ``s = r ^ alpha / w ^ (1 - alpha)`` (``s = r`` where ``w == 0``), floored at
1e-5; the weights are multiplied by ``s`` and the scale is folded into the norm that
feeds the group (:mod:`exportlm.quant._fold`); a group no norm can absorb the scale
of (``o_proj``, ``down_proj``, a norm that also feeds a router) is left unsmoothed, as
llm-compressor's mappings leave it (its default mappings smooth ``q/k/v`` <-
``input_layernorm`` and ``gate/up`` <- ``post_attention_layernorm``; its Mixtral and
Qwen-MoE mappings the attention only).

The ModelOpt layout keeps each linear's ``pre_quant_scale``, as ModelOpt writes it
for ``W8A8_SQ_PER_CHANNEL`` (TensorRT-LLM applies it; ModelOpt folds scales into
norms for AWQ formats only). Stacked experts are not smoothed (ModelOpt smooths
linears only); their weights and inputs are quantized as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from exportlm.quant._distributed import reduce_ranges
from exportlm.quant._fold import NormTrace, fold_into_norms
from exportlm.quant._modules import QuantLinear

__all__ = ["SmoothQuantPlan", "apply_smoothquant", "plan_smoothquant"]

logger = logging.getLogger(__name__)

#: ModelOpt's bounds of a smoothing scale and its zero-amax threshold.
_SCALE_MIN, _SCALE_MAX = 1e-4, 1e4
_EPSILON = 1.0 / (1 << 31)
#: llm-compressor's ``MINIMUM_SMOOTHING_SCALE``.
_LLMC_MIN_SCALE = 1e-5
#: llm-compressor doubles the weights' column amax (``weight_scales = 2.0 * ...``).
_LLMC_WEIGHT_FACTOR = 2.0


@dataclass
class SmoothQuantPlan:
    """The linears to smooth, the migration strength of each, and those whose scale folds."""

    linears: list[tuple[QuantLinear, float]]
    folding: set[int] = field(default_factory=set)
    #: The weights a folding recipe replaced (by linear id), restored if the fold fails.
    originals: dict[int, nn.Parameter] = field(default_factory=dict)
    #: Folding recipes: ``[min, max]`` per input channel seen in calibration (by linear id).
    ranges: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    hooks: list[RemovableHandle] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.linears)


def plan_smoothquant(model: nn.Module) -> SmoothQuantPlan:
    """The linears whose recipe smooths them; their input quantizers start tracking channels.

    Call before calibration: the smoothing reads the per-channel input amax.
    """
    plan = SmoothQuantPlan([])
    for module in model.modules():
        if not isinstance(module, QuantLinear) or not module.input_quantizer.enabled:
            continue
        alpha = module.smoothquant_alpha  # the recipe's, its ``alpha`` option applied
        if alpha is not None and module.weight_quantizer.enabled:
            module.input_quantizer.track_channels = True
            plan.linears.append((module, alpha))
            if module.smoothquant_fold:
                plan.folding.add(id(module))
                plan.hooks.append(_track_range(module, plan.ranges))
    return plan


def _track_range(module: QuantLinear, ranges: dict[int, list[torch.Tensor]]) -> RemovableHandle:
    """Record the per-channel min and max of ``module``'s input while it calibrates
    (llm-compressor's hook on the norm's output, which is this input)."""
    key = id(module)

    def hook(quantizer: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if not getattr(quantizer, "calibrating", False):
            return
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])
        low, high = x.amin(dim=0), x.amax(dim=0)
        seen = ranges.get(key)
        ranges[key] = (
            [low, high]
            if seen is None
            else [torch.minimum(seen[0], low), torch.maximum(seen[1], high)]
        )

    return module.input_quantizer.register_forward_pre_hook(hook)


def apply_smoothquant(
    model: nn.Module, plan: SmoothQuantPlan, groups: list[list[QuantLinear]], norms: NormTrace
) -> int:
    """Smooth every planned linear, then give each group of shared-input linears one scale.

    Folding recipes smooth each group jointly and fold the scale into its norm
    (``norms``: the norm outputs traced during calibration). Returns how many linears
    were smoothed. A linear calibration never reached keeps its weight (the final
    calibration check names it).
    """
    smoothed: set[int] = set()
    grouped = {id(m): g for g in groups for m in g}
    for handle in plan.hooks:
        handle.remove()
    _reduce_ranges(plan)
    with torch.no_grad():
        for module, alpha in plan.linears:
            quantizer = module.input_quantizer
            act = quantizer.channel_amax
            if act is None or id(module) in smoothed:
                continue
            if id(module) in plan.folding:
                members = grouped.get(id(module), [module])
                plan.originals.update({id(m): m.get_parameter("weight") for m in members})
                low, high = _tracked_range(plan.ranges.get(id(module)), act)
                _smooth_jointly(members, (high - low).float(), alpha)
                smoothed.update(map(id, members))
            else:
                _smooth(module, act.float(), alpha)
                smoothed.add(id(module))
        for module, _ in plan.linears:
            module.input_quantizer.track_channels = False
            module.input_quantizer.reset_channels()
        for group in groups:
            if len(group) > 1 and all(
                id(m) in smoothed and id(m) not in plan.folding for m in group
            ):
                _share_scale(group)
        if plan.folding:
            fold_into_norms(model, norms)
            smoothed -= _unsmooth_unfolded(model, plan)
    logger.info("SmoothQuant: smoothed %d linear(s)", len(smoothed))
    return len(smoothed)


def _reduce_ranges(plan: SmoothQuantPlan) -> None:
    """Data-parallel ranks: every folding linear's input range over all ranks' data."""
    folding = [id(m) for m, _ in plan.linears if id(m) in plan.folding]
    reduced = reduce_ranges([plan.ranges.get(key) for key in folding])
    plan.ranges = {key: r for key, r in zip(folding, reduced, strict=True) if r is not None}


def _tracked_range(
    tracked: list[torch.Tensor] | None, act: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input's per-channel ``(min, max)`` if it is the range of the statistic ``act`` holds.

    The range hook sees every calibration forward, including the one synthetic
    calibration runs only to trace the model; that calibration then replaces the
    channel amax with drawn values (machine-independent, unlike a forward pass's).
    The tracked range belongs to the same data exactly when its larger magnitude
    per channel is the amax (both are exact maxima of the same inputs); otherwise
    the range is the symmetric ``[-amax, amax]`` of the statistic in use.
    """
    if tracked is not None:
        low, high = tracked
        extent = torch.maximum(low.abs(), high.abs())
        if extent.shape == act.shape and torch.equal(extent, act.to(extent.dtype)):
            return low, high
    return -act, act


def _smooth_jointly(members: list[QuantLinear], act: torch.Tensor, alpha: float) -> None:
    """llm-compressor's ``_apply_smoothing`` of one mapping: one scale for the group.

    ``act`` is the input's per-channel dynamic range (``max - min``).
    """
    columns = torch.stack([m.weight.abs().amax(dim=0).float() for m in members]).amax(0)
    weight_amax = _LLMC_WEIGHT_FACTOR * columns
    scale = _power(act, alpha) / _power(weight_amax, 1 - alpha)
    scale = torch.where(weight_amax > 0, scale, act).clamp(min=_LLMC_MIN_SCALE)
    pqs = (1.0 / scale).to(members[0].weight.dtype)  # one object: the group shares it
    for module in members:
        weight = module.weight
        smoothed = (weight.float() * scale.to(weight.device)[None, :]).to(weight.dtype)
        module.weight = nn.Parameter(smoothed, requires_grad=weight.requires_grad)
        module.input_quantizer.pre_quant_scale = pqs
        module.input_quantizer.weight_smoothed = True


def _power(x: torch.Tensor, exponent: float) -> torch.Tensor:
    """``x ** exponent`` in float32, the same bits on every CPU and kernel set.

    torch's float32 ``sqrt`` and ``pow`` are SIMD-library functions whose last bit is
    not specified (torch 2.13 CPU on an AMD EPYC: ``torch.sqrt`` differs from the
    correctly rounded square root in 14 % of 100,000 values, under every
    ``ATEN_CPU_CAPABILITY``), and the w8a8 golden's ``weight_scale`` bytes differed
    between an Intel and an AMD machine. numpy's ``sqrt`` is the IEEE 754 operation,
    correctly rounded on every machine; 0.5 (llm-compressor's default strength) takes
    it. Another exponent is computed in float64 and rounded once to float32: its last
    float32 bit can then differ only where the float64 value lies within float64's
    error of a float32 rounding boundary.
    """
    values = x.detach().to("cpu", torch.float32).numpy()
    if exponent == 0.5:
        result = np.sqrt(values)
    elif exponent == 1:
        result = values.copy()
    else:
        result = np.power(values.astype(np.float64), exponent).astype(np.float32)
    return torch.from_numpy(result).to(x.device)


def _unsmooth_unfolded(model: nn.Module, plan: SmoothQuantPlan) -> set[int]:
    """Restore the folding recipe's linears whose scale no norm absorbed; returns their ids."""
    restored: set[int] = set()
    names = {id(m): n for n, m in model.named_modules()}
    for module, _ in plan.linears:
        quantizer = module.input_quantizer
        original = plan.originals.pop(id(module), None)
        if id(module) not in plan.folding or quantizer.pre_quant_scale is None:
            continue
        if original is not None:
            module.weight = original
        quantizer.pre_quant_scale = None
        quantizer.weight_smoothed = False
        restored.add(id(module))
        logger.info(
            "SmoothQuant: %s is not smoothed: no norm feeding only its group can absorb "
            "the scale (llm-compressor's mappings smooth norm-fed linears only)",
            names.get(id(module), "a linear"),
        )
    return restored


def _smooth(module: QuantLinear, act: torch.Tensor, alpha: float) -> None:
    """ModelOpt's ``postprocess`` + ``apply_pre_quant_scale_and_smooth`` of one linear."""
    weight = module.weight
    dtype = weight.dtype
    weight_amax = weight.abs().amax(dim=0, keepdim=True)
    scale = (weight_amax.pow(1 - alpha) / act.pow(alpha)).squeeze()
    if scale.min() <= _EPSILON:
        scale[act <= _EPSILON] = 1
    scale = scale.clamp(min=_SCALE_MIN, max=_SCALE_MAX).to(torch.float32)
    quantizer = module.input_quantizer
    quantizer.pre_quant_scale = scale.to(dtype)
    quantizer.weight_smoothed = True
    smoothed = (weight * (1.0 / scale).to(weight.device)[None, :]).to(dtype)
    module.weight = nn.Parameter(smoothed, requires_grad=weight.requires_grad)
    quantizer.amax = (act.to(dtype) * scale.to(act.device)).amax().to(dtype).float()


def _share_scale(group: list[QuantLinear]) -> None:
    """ModelOpt's resmoothing of linears fused into one GEMM: the mean scale for all."""
    scales = [m.input_quantizer.pre_quant_scale for m in group]
    if any(s is None for s in scales):  # pragma: no cover - smoothed linears have one
        return
    mean = torch.mean(torch.stack([s for s in scales if s is not None]), dim=0)
    for module in group:
        old = module.input_quantizer.pre_quant_scale
        if old is not None and not torch.equal(old, mean):
            weight = module.weight
            rescaled = weight.to(torch.float32) * old.to(torch.float32) / mean.to(torch.float32)
            module.weight = nn.Parameter(
                rescaled.to(weight.dtype), requires_grad=weight.requires_grad
            )
        module.input_quantizer.pre_quant_scale = mean  # one object: the group shares it
