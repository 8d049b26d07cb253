"""Fake-quantized models as QDQ ONNX graphs: which models fit, and the export-time swap.

A model converted by :func:`exportlm.quant.quantize` exports to ONNX with its
quantized weights kept: every quantized linear's ``weight`` becomes an initializer
of the format's stored type (FP8: ``FLOAT8E4M3FN`` with a per-tensor
``weight_scale``; INT8 weight-only: ``INT8`` with per-row ``weight_scale``) read
through ``DequantizeLinear``, and FP8's static activation scale (``input_scale``)
becomes ``QuantizeLinear(saturate) -> DequantizeLinear`` on the linear's input.
The initializers are named like the checkpoint tensors of the ``hf_checkpoint``
target, and their bytes are the format kernel's output: the same bytes.

:func:`quantized_graph` does this during the export only: each quantized linear's
float ``weight`` parameter is set aside, the quantized tensors are registered as its
buffers, and its forward runs the :mod:`~exportlm.export.onnx._qdq_ops` custom ops;
on exit the module has its very parameters back, in their order, and its forward.

What has no ONNX form here is refused up front (:func:`qdq_refusal`): formats other
than :data:`~exportlm.export.onnx._qdq_ops.QDQ_SCHEMES` (NVFP4, INT4 AWQ), AWQ
pre-quant scales, KV-cache quantizers, quantized embeddings and stacked (fused)
MoE experts.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exportlm.errors import (
    InvalidInputError,
    InvalidOptionError,
    QuantizationError,
    UnsupportedFormatError,
)
from exportlm.export.onnx._qdq_ops import QDQ_SCHEMES, qdq_ops, translation_table
from exportlm.quant import (
    QuantLinear,
    TensorQuantizer,
    get_format,
    is_quantized_module,
    recipes_for_format,
)

__all__ = ["check_quantized_export", "qdq_refusal", "quantized_graph", "quantized_linears"]


def _supported() -> str:
    return ", ".join(
        f"{' / '.join(recipes_for_format(s.format) or [s.recipe])} ({s.format})"
        for s in QDQ_SCHEMES.values()
    )


def _recipe_of(quantizer: TensorQuantizer) -> str:
    """The recipe ``quantizer`` was quantized with (``"recipe 'int4_gptq' (int4)"``), else
    its format and every recipe that writes it: a format may have several recipes."""
    if quantizer.recipe:
        return f"recipe {quantizer.recipe!r} ({quantizer.format})"
    names = " or ".join(repr(n) for n in recipes_for_format(quantizer.format))
    return f"format {quantizer.format}" + (f" (recipe {names})" if names else "")


def _module_refusal(name: str, module: nn.Module) -> str | None:
    """Why the quantized module ``name`` has no QDQ ONNX form, or ``None``."""
    if not isinstance(module, QuantLinear):
        return (
            f"{name} ({type(module).__name__}) is quantized, and only quantized linears "
            "(QuantLinear) export as QDQ ONNX; quantized embeddings and stacked MoE experts "
            "do not (exclude them from quantization, or use the hf_checkpoint target)"
        )
    weight, inputs = module.weight_quantizer, module.input_quantizer
    if module.output_quantizer.enabled:
        return (
            f"{name} quantizes its output for the KV cache (recipe fp8_kv), which the onnx "
            "target cannot express; quantize without the KV-cache recipe"
        )
    if inputs.pre_quant_scale is not None:
        return f"{name} carries a pre_quant_scale ({_recipe_of(weight)}), which has no QDQ form"
    if weight.enabled:
        scheme = QDQ_SCHEMES.get(get_format(weight.format).name)
        if scheme is None or weight.block_size:
            return (
                f"{name} is quantized with {_recipe_of(weight)}, which the onnx target "
                f"cannot express; supported: {_supported()}"
            )
        if (scheme.axis is None) != (weight.axis is None):
            return f"{name}: {weight.format} weights with axis={weight.axis} have no QDQ form"
    if inputs.enabled:
        scheme = QDQ_SCHEMES.get(get_format(inputs.format).name)
        if scheme is None or not scheme.activations or inputs.axis is not None:
            return (
                f"{name} quantizes its input with {inputs.format} (axis={inputs.axis}); the onnx "
                "target quantizes activations only per tensor in fp8"
            )
    return None


def quantized_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every module of ``model`` with an active quantizer."""
    for name, module in model.named_modules():
        if is_quantized_module(module):
            yield name or type(model).__name__, module


def qdq_refusal(model: Any) -> str | None:
    """Why the ``onnx`` target cannot export ``model``'s quantization, or ``None``.

    ``None`` for an unquantized model and for one whose every quantized module is a
    linear in a :data:`~exportlm.export.onnx._qdq_ops.QDQ_SCHEMES` format. The reason
    names the module, its recipe and the supported recipes.
    """
    if not isinstance(model, nn.Module):
        return None  # the export job says what a model must be
    for name, module in quantized_linears(model):
        reason = _module_refusal(name, module)
        if reason:
            return reason
    return None


def _uncalibrated(name: str, role: str, quantizer: TensorQuantizer) -> QuantizationError:
    return QuantizationError(
        f"{name}.{role} ({quantizer.format}) has no amax: the model was never calibrated, so "
        "the onnx target has no scale to write. Calibrate first: quantize(model, recipe, "
        "calibrate=fn) with a forward that reaches this module, or set its amax"
    )


def check_quantized_export(model: Any, *, opset: int, dynamo: bool) -> bool:
    """Validate a quantized ``model`` for a QDQ export; returns whether it is quantized at all.

    Raises:
        UnsupportedFormatError: a quantized module has no QDQ form (:func:`qdq_refusal`).
        InvalidOptionError: ``dynamo=False`` (the legacy exporter folds quantized weights
            to float), or ``opset`` is below the formats' ``DequantizeLinear`` opset.
        QuantizationError: a calibrated quantizer has no amax (calibrate first).
    """
    if not isinstance(model, nn.Module):
        return False
    modules = list(quantized_linears(model))
    if not modules:
        return False
    reason = qdq_refusal(model)
    if reason:
        raise UnsupportedFormatError(f"onnx export: {reason}")
    if not dynamo:
        raise InvalidOptionError(
            "onnx export of a quantized model needs dynamo=True: the legacy exporter "
            "(dynamo=False) cannot keep quantized initializers"
        )
    for name, module in modules:
        for role in ("weight_quantizer", "input_quantizer"):
            quantizer: TensorQuantizer = getattr(module, role)
            if not quantizer.enabled:
                continue
            scheme = QDQ_SCHEMES[get_format(quantizer.format).name]
            if opset < scheme.min_opset:
                raise InvalidInputError(
                    f"onnx export: {name}.{role} is {quantizer.format}, whose ONNX "
                    f"DequantizeLinear needs opset >= {scheme.min_opset}; got opset={opset}. "
                    f"Pass opset={max(scheme.min_opset, 19)} or higher (18-22 are tested)"
                )
            calibrated = quantizer.amax is not None or quantizer.static_scale is not None
            if quantizer.spec.calibrated and not calibrated:
                raise _uncalibrated(name, role, quantizer)
    return True


@dataclass
class _Swap:
    """One quantized linear during the export, with what restores it."""

    module: QuantLinear
    parameters: list[tuple[str, nn.Parameter]]
    buffers: tuple[str, ...]
    forward: Callable[..., Any] | None


def _qdq_forward(
    module: nn.Module, fmt: str, act_fmt: str | None, dtype: torch.dtype, x: torch.Tensor
) -> torch.Tensor:
    """The swapped forward: what :meth:`QuantLinear.forward` computes, through the custom ops."""
    dequantize_op, fake_quantize_op = qdq_ops()
    if act_fmt is not None:
        scale = module.get_buffer("input_scale")
        x = fake_quantize_op(x.to(torch.float32), scale, act_fmt).to(x.dtype)
    codes, scale = module.get_buffer("weight"), module.get_buffer("weight_scale")
    weight = dequantize_op(codes, scale, fmt).to(dtype)
    bias = module.bias if isinstance(module.bias, torch.Tensor) else None
    return F.linear(x, weight, bias)


def _swap_in(module: QuantLinear) -> _Swap:
    """Replace ``module``'s float weight by its quantized tensors and its forward by QDQ ops."""
    weight_q, input_q = module.weight_quantizer, module.input_quantizer
    dtype = module.weight.dtype
    with torch.no_grad():
        quantized = weight_q.quantize(module.effective_weight())
    act_fmt = get_format(input_q.format).name if input_q.enabled else None
    input_scale = input_q.scale.detach().to(torch.float32) if input_q.enabled else None
    swap = _Swap(
        module,
        [(n, p) for n, p in module.named_parameters(recurse=False)],
        ("weight", "weight_scale") + (("input_scale",) if input_scale is not None else ()),
        vars(module).get("forward"),
    )
    del module.weight
    module.register_buffer("weight", quantized.data)
    module.register_buffer("weight_scale", quantized.scale.detach().to(torch.float32))
    if input_scale is not None:
        module.register_buffer("input_scale", input_scale)
    fmt = get_format(weight_q.format).name
    # An instance attribute: nn.Module.__call__ looks forward up on the instance first.
    module.forward = functools.partial(  # type: ignore[method-assign]
        _qdq_forward, module, fmt, act_fmt, dtype
    )
    return swap


def _swap_out(swap: _Swap) -> None:
    """Give the module its forward, and its parameters back in their original order."""
    module = swap.module
    if swap.forward is None:
        delattr(module, "forward")
    else:
        module.forward = swap.forward  # type: ignore[method-assign]
    for name in swap.buffers:
        delattr(module, name)
    for name, _ in swap.parameters:
        if name != "weight":
            delattr(module, name)
    for name, parameter in swap.parameters:
        module.register_parameter(name, parameter)


@contextlib.contextmanager
def quantized_graph(
    model: nn.Module, *, opset: int
) -> Iterator[dict[Any, Callable[..., Any]] | None]:
    """Within the block, ``model``'s quantized linears trace as QDQ ops; yields the translations.

    Yields ``custom_translation_table`` entries for ``torch.onnx.export``, or ``None``
    when ``model`` has no quantized module (nothing is changed then). Call
    :func:`check_quantized_export` first. The model is restored on exit, also on error.
    """
    modules = [m for _, m in quantized_linears(model) if isinstance(m, QuantLinear)]
    if not modules:
        yield None
        return
    table = translation_table(opset)
    swaps: list[_Swap] = []
    try:
        for module in modules:
            swaps.append(_swap_in(module))
        yield table
    finally:
        for swap in reversed(swaps):
            _swap_out(swap)
