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

The ModelOpt layout keeps each linear's ``pre_quant_scale``, as ModelOpt writes it
for ``W8A8_SQ_PER_CHANNEL`` (TensorRT-LLM applies it; ModelOpt folds scales into
norms for AWQ formats only). Stacked experts are not smoothed (ModelOpt smooths
linears only); their weights and inputs are quantized as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from exportlm.quant._modules import QuantLinear

__all__ = ["SmoothQuantPlan", "apply_smoothquant", "plan_smoothquant"]

logger = logging.getLogger(__name__)

#: ModelOpt's bounds of a smoothing scale and its zero-amax threshold.
_SCALE_MIN, _SCALE_MAX = 1e-4, 1e4
_EPSILON = 1.0 / (1 << 31)


@dataclass
class SmoothQuantPlan:
    """The linears to smooth and the migration strength of each."""

    linears: list[tuple[QuantLinear, float]]

    def __bool__(self) -> bool:
        return bool(self.linears)


def plan_smoothquant(model: nn.Module) -> SmoothQuantPlan:
    """The linears whose recipe smooths them; their input quantizers start tracking channels.

    Call before calibration: the smoothing reads the per-channel input amax.
    """
    linears = []
    for module in model.modules():
        if not isinstance(module, QuantLinear) or not module.input_quantizer.enabled:
            continue
        recipe = module.weight_quantizer.spec.recipe
        alpha = None if recipe is None else recipe.smoothquant_alpha
        if alpha is not None and module.weight_quantizer.enabled:
            module.input_quantizer.track_channels = True
            linears.append((module, alpha))
    return SmoothQuantPlan(linears)


def apply_smoothquant(plan: SmoothQuantPlan, groups: list[list[QuantLinear]]) -> int:
    """Smooth every planned linear, then give each group of shared-input linears one scale.

    Returns how many linears were smoothed. A linear calibration never reached keeps
    its weight (the final calibration check names it).
    """
    smoothed: set[int] = set()
    with torch.no_grad():
        for module, alpha in plan.linears:
            quantizer = module.input_quantizer
            act = quantizer.channel_amax
            quantizer.track_channels = False
            if act is None:
                continue
            _smooth(module, act.float(), alpha)
            quantizer.reset_channels()
            smoothed.add(id(module))
        for group in groups:
            if len(group) > 1 and all(id(m) in smoothed for m in group):
                _share_scale(group)
    logger.info("SmoothQuant: smoothed %d linear(s)", len(smoothed))
    return len(smoothed)


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
