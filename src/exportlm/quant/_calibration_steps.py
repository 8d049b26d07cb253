"""The calibration steps of :func:`~exportlm.quant.quantize`, in their order.

The forwards (with what the recipes trace during them: expert statistics, GPTQ's
Hessians, the norms and blocks AWQ folds into), then the AWQ search and its smoothing
and folds, SmoothQuant, GPTQ, and last the weight quantizers' amax from the weights
those steps changed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from exportlm.quant._awq import (
    apply_awq,
    clip_awq,
    collect_expert_statistics,
    plan_awq,
    search_awq,
)
from exportlm.quant._awq_moe import smooth_moe_inputs, trace_moe_inputs
from exportlm.quant._calibrate import run_calibration
from exportlm.quant._expert_modules import QuantExperts
from exportlm.quant._fold import fold_into_norms, trace_norms
from exportlm.quant._fold_experts import fold_experts, prune_expert_searches
from exportlm.quant._fold_linear import fold_into_linears, prune_unfoldable, trace_blocks
from exportlm.quant._gptq_apply import apply_gptq, collect_hessians
from exportlm.quant._modules import QuantEmbedding, QuantLinear, QuantModule
from exportlm.quant._quantizer import TensorQuantizer
from exportlm.quant._smoothquant import apply_smoothquant, plan_smoothquant
from exportlm.quant._static_inputs import (
    keep_channel_amax,
    search_formats,
    set_smoothed_input_amax,
)
from exportlm.quant._tensor import by_expert, experts_abs_max
from exportlm.quant._transaction import QuantizeSteps

__all__ = ["calibrate_and_smooth", "init_weight_amax"]


def calibrate_and_smooth(
    model: nn.Module,
    calibrate: Callable[[nn.Module], object] | None,
    steps: QuantizeSteps,
    awq: bool,
) -> list[list[QuantLinear]]:
    """Calibration, then the AWQ search, smoothing and folds, SmoothQuant and GPTQ (as the
    recipes ask); returns the groups of linears that read one input."""
    smoothquant = plan_smoothquant(model)
    with steps.step("calibration (the calibrate function's forwards)"):
        handles = collect_expert_statistics(model) if awq else []
        hessians = collect_hessians(model, handles)  # GPTQ linears: X^T X of their inputs
        try:
            with (
                trace_norms(model, enabled=awq or bool(smoothquant.folding)) as norms,
                trace_blocks(model) as blocks,  # compressed-tensors AWQ: what folds into linears
                trace_moe_inputs(model, enabled=awq) as moe_inputs,  # and into a MoE's norm
            ):
                groups = run_calibration(model, calibrate)
        finally:
            for handle in handles:
                handle.remove()
    if awq:
        plan = plan_awq(model, groups)
        prune_unfoldable(model, plan, norms, blocks)
        prune_expert_searches(plan)
        with search_formats(model):  # w4a8: the INT4 stage alone, as ModelOpt searches
            with steps.step("the AWQ search (a second pass of the calibrate function's forwards)"):
                search_awq(model, plan, calibrate)
            with steps.step("AWQ smoothing and its fold into norms"):
                static_inputs = keep_channel_amax(model)  # w4a8_awq: FP8 inputs after the scale
                apply_awq(plan)
                clip_awq(model, plan)  # each INT4 group's range, on the scaled weight
                fold_into_norms(model, norms)
                fold_into_linears(model, blocks)
                fold_experts(plan)  # compressed-tensors: experts keep no AWQ scale
                set_smoothed_input_amax(static_inputs)
            with steps.step("AWQ: each MoE block's input scale (another pass of the forwards)"):
                smooth_moe_inputs(model, moe_inputs, norms, calibrate)
    if smoothquant:
        with steps.step("SmoothQuant smoothing"):
            apply_smoothquant(model, smoothquant, groups, norms)
    if hessians:
        with steps.step("GPTQ (each linear's weight quantized column by column)"):
            apply_gptq(hessians)
    init_weight_amax(model)  # AWQ changed the weights the quantizers see
    return groups


def _weights(module: QuantModule) -> Iterator[tuple[TensorQuantizer, torch.Tensor]]:
    if isinstance(module, QuantLinear):
        yield module.weight_quantizer, module.effective_weight()
    elif isinstance(module, QuantEmbedding):
        yield module.weight_quantizer, module.weight


def init_weight_amax(model: nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantExperts):
                for proj in module.PROJECTIONS:
                    _init_experts_amax(module, proj)
            elif isinstance(module, QuantModule):
                for quantizer, weight in _weights(module):
                    if quantizer.enabled:
                        quantizer.reset_amax()
                        quantizer.collect(weight)


def _init_experts_amax(module: QuantExperts, proj: str) -> None:
    """The weight amax of ``proj``'s experts, each expert's effective weight one at a time
    (``collect(effective_weight(proj))``'s values without the stack's copy: the AWQ quotient,
    DBRX's ``[w1; v1]``; what a streamed MoE layer's calibration peaked on, docs/streaming.md)."""
    quantizer = module.weight_quantizer_of(proj)
    if not quantizer.enabled:
        return
    quantizer.reset_amax()
    stack = torch.empty((module.num_experts, 1, 1), device="meta")  # the stack's shape alone
    if by_expert(stack, quantizer.axis) and not quantizer.track_channels:
        divided = functools.partial(module.effective_expert, proj)
        quantizer.amax = experts_abs_max(divided, module.num_experts, quantizer.axis)
    else:
        quantizer.collect(module.effective_weight(proj))
