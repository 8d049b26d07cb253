"""AWQ on stacked experts in the compressed-tensors convention: no per-expert scale is kept.

compressed-tensors has no ``pre_quant_scale`` tensor; llm-compressor smooths every AWQ scale
into the op before the layer (its MoE mappings: ``post_attention_layernorm`` -> the router
and every expert's ``gate_proj`` / ``up_proj``, one scale for all; each expert's
``up_proj`` -> its own ``down_proj``). Per expert here:

* ``down_proj``: the expert's scale is folded into the rows of its ``up`` part of
  ``gate_up_proj`` (and its bias), and ``down_proj`` is stored divided by it, as llm-compressor's
  ``up_proj -> down_proj`` mapping does. Only where the experts' gate is linear in ``up``
  (``act(gate) * up``: Mixtral, Qwen-MoE, Llama4), verified on the module's own ``_apply_gate``
  with a probe scale of powers of two (exact in floating point); GPT-OSS's
  ``(clamp(up) + 1) * glu`` fails it, and its ``down_proj`` is round-to-nearest.
* ``gate_up_proj``: one scale per expert cannot fold into the norm that feeds every expert
  and the router; its per-expert scale is dropped here, and the single scale shared by the
  router and all the experts is searched and folded into the norm by
  :mod:`exportlm.quant._awq_moe` (round-to-nearest where that cannot fold).

Nothing else changes: a checkpoint of the convention quantizes every expert linear, written
per expert (``experts.{e}.gate_proj.weight_packed`` ...), with no AWQ scale left to store.
"""

from __future__ import annotations

import logging

import torch

from exportlm.quant._awq import AWQPlan
from exportlm.quant._expert_modules import QuantExperts
from exportlm.quant._modules import replaced_parameter

__all__ = ["fold_experts", "gate_is_linear_in_up", "prune_expert_searches"]

logger = logging.getLogger(__name__)

#: The probe scale's values: powers of two, so scaling is exact in floating point.
_PROBE = (0.25, 4.0, 0.5, 2.0, 8.0, 0.125)
_ULPS = 8


def _convention(module: QuantExperts, projection: str) -> bool:
    weights = module.weight_quantizer_of(projection)
    inputs = module.input_quantizer_of(projection)
    return (
        module.stores_fused_parameters
        and inputs.track_channels
        and (weights.scales == "compressed-tensors")
    )


def gate_is_linear_in_up(module: QuantExperts) -> bool:
    """``module._apply_gate`` times a probe on the ``up`` columns equals its output times it."""
    columns = 2 * module.canonical_weight("down_proj").shape[-1]
    _, up = module.split_gate_up(torch.arange(columns), dim=-1)
    inner = columns // 2
    probe = torch.tensor(_PROBE).repeat(inner // len(_PROBE) + 1)[:inner]
    factor = torch.ones(columns)
    factor[up] = probe
    sample = torch.randn(16, columns, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            want = module._apply_gate(sample) * probe
            got = module._apply_gate(sample * factor)
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        logger.info("AWQ: %s's gate cannot be probed (%s)", type(module).__name__, e)
        return False
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    bound = _ULPS * torch.finfo(want.dtype).eps * (want.abs() + want.abs().mean() * 1e-3)
    return bool(((got - want).abs() <= bound).all())


def prune_expert_searches(plan: AWQPlan) -> None:
    """Under the convention, search only the experts' scales that fold (``down_proj``'s)."""
    for index, (module, proj, per_expert) in enumerate(plan.experts):
        if not _convention(module, proj):
            continue
        if proj == "down_proj" and gate_is_linear_in_up(module):
            continue
        plan.experts[index] = (module, proj, [None] * len(per_expert))


def fold_experts(plan: AWQPlan) -> int:
    """Fold or drop every per-expert scale of the convention; returns how many modules folded."""
    folded = 0
    with torch.no_grad():
        for module, proj, _ in plan.experts:
            if not _convention(module, proj):
                continue
            quantizer = module.input_quantizer_of(proj)
            scale, quantizer.pre_quant_scale = quantizer.pre_quant_scale, None
            if scale is None or proj != "down_proj" or not gate_is_linear_in_up(module):
                continue  # round-to-nearest
            _fold_down_into_up(module, scale.reshape(module.num_experts, -1))
            folded += 1
    return folded


def _fold_down_into_up(module: QuantExperts, scale: torch.Tensor) -> None:
    """``up`` rows (and bias) times ``scale [E, I]``; ``down_proj`` divided by it, as the
    AWQ quotient ``W / s`` of the scale kept would have been (in the weight's dtype)."""
    gate_up = replaced_parameter(module, "gate_up_proj")
    canonical = gate_up.transpose(-1, -2) if module.transposed else gate_up
    _, up = module.split_gate_up(canonical, dim=-2)  # a view: [E, I, H]
    up.copy_((up.float() * scale.float()[:, :, None]).to(up.dtype))
    bias = module.bias_of("gate_up_proj")
    if bias is not None:
        new_bias = replaced_parameter(module, "gate_up_proj_bias")
        _, up_bias = module.split_gate_up(new_bias, dim=-1)
        up_bias.copy_((up_bias.float() * scale.float()).to(up_bias.dtype))
    down = replaced_parameter(module, "down_proj")
    canonical = down.transpose(-1, -2) if module.transposed else down  # [E, H, I]
    canonical.copy_(canonical / scale[:, None, :].to(canonical.dtype))
