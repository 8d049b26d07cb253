"""Quantized module wrappers: the originals with quantizers attached.

Conversion swaps a module's class in place (``module.__class__``), the way
ModelOpt's dynamic modules do: parameters, buffers, hooks and tied parameters
stay the very same objects, so the converted model still runs and a
``state_dict`` keeps its parameter names. A wrapper's class subclasses the
original (``QuantLinear`` is an ``nn.Linear``; the fused-experts wrapper of
``MixtralExperts`` is a ``MixtralExperts``), which is what the export registry's
MRO matching relies on. The stacked-experts wrappers' base is in
:mod:`exportlm.quant._expert_modules`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from exportlm.quant._quantizer import TensorQuantizer

__all__ = [
    "QuantEmbedding",
    "QuantLinear",
    "QuantMoELinear",
    "QuantModule",
    "is_quantized_module",
    "replaced_parameter",
    "smoothing_of",
]


class QuantModule(nn.Module):
    """Mixin of every quantized wrapper.

    Attributes set by :func:`~exportlm.quant.quantize`:
        quant_algo: the ModelOpt algorithm name of the module's weights
            (``"FP8"``, ``"NVFP4"``, ``"W4A16_AWQ"``, ``"W8A16"``), or ``None``
            when only its KV-cache output is quantized.
        group_size: NVFP4 block / AWQ group size, else ``None``.
        smoothquant_alpha: the SmoothQuant strength of the module's recipe (its
            ``alpha`` option applied), ``None`` for a recipe without smoothing.
        smoothquant_fold: the recipe smooths only linears whose scale folds into the
            norm feeding them (``w8a8``).
    """

    quant_algo: str | None = None
    group_size: int | None = None
    smoothquant_alpha: float | None = None
    smoothquant_fold: bool = False

    def quantizers(self) -> Iterator[tuple[str, TensorQuantizer]]:
        """``(attribute name, quantizer)`` of this module's own quantizers."""
        for name, child in self.named_children():
            if isinstance(child, TensorQuantizer):
                yield name, child


def smoothing_of(quantizer: TensorQuantizer) -> torch.Tensor | None:
    """The AWQ scale the input of ``quantizer``'s linear is multiplied by, wherever it is
    applied: its ``pre_quant_scale`` or the ``folded_pre_quant_scale`` a norm applies."""
    if quantizer.pre_quant_scale is not None:
        return quantizer.pre_quant_scale
    return quantizer.folded_pre_quant_scale


def replaced_parameter(module: nn.Module, attr: str) -> torch.Tensor:
    """A new ``Parameter`` for ``module.attr`` (a copy of it; the original object is left for a
    rolled-back ``quantize``, which restores parameters by identity), returned as its data to
    write into."""
    param = module.get_parameter(attr)
    setattr(module, attr, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
    return module.get_parameter(attr).data


def is_quantized_module(module: nn.Module) -> bool:
    """True for a quantized wrapper with at least one active quantizer.

    Active: enabled, or carrying an AWQ ``pre_quant_scale``. A wrapper whose
    quantizers are all disabled behaves (and exports) like the original module.
    """
    if not isinstance(module, QuantModule):
        return False
    return any(q.enabled or q.pre_quant_scale is not None for _, q in module.quantizers())


class QuantLinear(QuantModule, nn.Linear):
    """``nn.Linear`` with ``input_quantizer``, ``weight_quantizer`` and ``output_quantizer``.

    ``y = output_quantizer(linear(input_quantizer(x), weight_quantizer(W / pqs), b))``
    where ``pqs`` is the input quantizer's AWQ ``pre_quant_scale`` (1 without AWQ).
    The output quantizer is the KV-cache quantizer of ``k_proj`` / ``v_proj``
    (its ``kv_role`` is ``"k"`` or ``"v"``); it is disabled elsewhere. Where the
    attention caches another tensor than the projection's output (transformers
    attentions: K after RoPE / ``k_norm``), its ``kv_site`` is ``"attention"`` and
    the attention function applies it instead
    (:func:`~exportlm.quant.route_kv_cache_to_attention`).
    """

    weight_quantizer: TensorQuantizer
    input_quantizer: TensorQuantizer
    output_quantizer: TensorQuantizer

    def effective_weight(self) -> torch.Tensor:
        """The weight the quantizer sees: ``W / pre_quant_scale`` under AWQ, else ``W``.

        The scale is the input quantizer's ``pre_quant_scale``, or its
        ``folded_pre_quant_scale`` when the preceding norm applies it; ``W`` itself when
        the weight is stored smoothed (SmoothQuant: ``input_quantizer.weight_smoothed``).
        """
        pqs = smoothing_of(self.input_quantizer)
        weight: torch.Tensor = self.weight
        if pqs is None or self.input_quantizer.weight_smoothed:
            return weight
        scaled: torch.Tensor = weight / pqs.to(weight.dtype)
        return scaled

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """The fake-quantized linear."""
        x = self.input_quantizer(input)
        weight = self.weight_quantizer(self.effective_weight())
        out: torch.Tensor = F.linear(x, weight, self.bias)
        if self.output_quantizer.kv_site == "projection":  # else the attention function runs it
            out = self.output_quantizer(out)
        return out


class QuantMoELinear(QuantLinear):
    """A :class:`QuantLinear` that is one projection of one expert in an iterable MoE.

    Its own class so that the MoE-linear exporter (registered before the linear
    one) claims it by its class name.
    """


class QuantEmbedding(QuantModule, nn.Embedding):
    """``nn.Embedding`` whose table goes through ``weight_quantizer`` (weight-only)."""

    weight_quantizer: TensorQuantizer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Look up rows of the fake-quantized table."""
        return F.embedding(
            input,
            self.weight_quantizer(self.weight),
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
