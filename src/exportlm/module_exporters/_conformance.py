"""What an exporter gives the conformance suite's value checks: a model, and a way back.

:meth:`ModuleExporter.conformance_model <exportlm.module_exporters.ModuleExporter.conformance_model>`
builds a small model holding the modules an exporter claims;
:meth:`ModuleExporter.dequantized_module <exportlm.module_exporters.ModuleExporter.dequantized_module>`
turns the tensors it wrote for one module back into a float module whose forward
must reproduce the fake-quantized module's. :func:`library_dequantized_module` is
that default for the layouts the library's formats know (``weight`` + the format's
scale leaves, ``bias``, ``input_scale``, ``pre_quant_scale``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.quant import TensorQuantizer, dequantize

__all__ = ["ConformanceModel", "DequantizedLinear", "library_dequantized_module"]


class ConformanceModel(nn.Module):
    """Deep copies of an exporter's ``conformance_examples()``, as ``examples.{i}``."""

    def __init__(self, examples: Sequence[nn.Module]) -> None:
        super().__init__()
        self.examples = nn.ModuleList(copy.deepcopy(list(examples)))


class DequantizedLinear(nn.Module):
    """``linear(input_quantizer(x), weight, bias)`` from stored tensors, in float32.

    ``input_quantizer`` is a copy of the fake-quantized module's, reading the
    stored ``input_scale`` (and ``pre_quant_scale``) instead of its calibration,
    or ``None`` when the module's inputs are not quantized.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        input_quantizer: TensorQuantizer | None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.input_quantizer = input_quantizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The dequantized linear."""
        if self.input_quantizer is not None:
            x = self.input_quantizer(x)
        return F.linear(x.float(), self.weight, self.bias)


def _weight(quantizer: TensorQuantizer | None, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight stored as ``weight`` (+ its format's scale leaves)."""
    if quantizer is None or not quantizer.enabled:
        return tensors["weight"].float()
    spec = quantizer.spec
    stored = {leaf.name: tensors[leaf.name] for leaf in spec.weight_leaves if leaf.name in tensors}
    return dequantize(spec.from_leaves(stored), torch.float32)


def _input_quantizer(
    module: nn.Module, tensors: Mapping[str, torch.Tensor]
) -> TensorQuantizer | None:
    """A copy of the module's input quantizer reading the stored scales, or ``None``."""
    original = getattr(module, "input_quantizer", None)
    if not isinstance(original, TensorQuantizer):
        return None
    if not original.enabled and original.pre_quant_scale is None:
        return None
    reader = copy.deepcopy(original)
    if original.enabled and "input_scale" in tensors:
        reader.static_scale = tensors["input_scale"].float().reshape(())
    if original.pre_quant_scale is not None:
        reader.pre_quant_scale = tensors.get("pre_quant_scale")
    return reader


def library_dequantized_module(
    module: nn.Module, tensors: Mapping[str, torch.Tensor]
) -> nn.Module | None:
    """A float module rebuilt from ``tensors`` (names relative to the module) with the
    library's formats, or ``None`` for a module that is no linear or embedding.

    The weight is read with the format of the module's ``weight_quantizer``
    (:meth:`~exportlm.quant.formats.FormatSpec.from_leaves`, then
    :func:`~exportlm.quant.dequantize`); a linear's input is quantized with a copy of
    its ``input_quantizer`` that uses the stored ``input_scale`` and
    ``pre_quant_scale``. Raises :class:`~exportlm.errors.UnsupportedFormatError`
    when ``weight`` or one of its format's leaves is missing.
    """
    if "weight" not in tensors:
        raise UnsupportedFormatError(
            f"no 'weight' among the tensors written for this {type(module).__name__} "
            f"({sorted(tensors)}); override dequantized_module() for another layout"
        )
    quantizer = getattr(module, "weight_quantizer", None)
    weight = _weight(quantizer if isinstance(quantizer, TensorQuantizer) else None, tensors)
    if isinstance(module, nn.Embedding):
        table: nn.Module = nn.Embedding.from_pretrained(weight)
        return table
    if isinstance(module, nn.Linear):
        return DequantizedLinear(weight, tensors.get("bias"), _input_quantizer(module, tensors))
    return None
