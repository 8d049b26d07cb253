"""The quantized formats an ONNX graph can hold, and the ops that put them there.

A fake-quantized linear exports as ONNX's QDQ pattern: its weight is a quantized
initializer read through ``DequantizeLinear``, and a static activation scale
becomes ``QuantizeLinear -> DequantizeLinear`` on the input. Two
:mod:`torch.library` custom ops carry this through ``torch.export``:

* ``exportlm::dequantize(codes, scale, fmt)``: the format's own dequantize kernel
  (:attr:`FormatSpec.dequantize <exportlm.quant.FormatSpec.dequantize>`), float32 out;
* ``exportlm::fake_quantize(x, scale, fmt)``: the format's quantize kernel then its
  dequantize kernel on a float32 activation (what the quantizer's forward computes).

Their eager implementations are the formats' kernels, so a graph traced through them
computes what the fake-quantized model computes; :func:`translation_table` maps them to
``DequantizeLinear`` / ``QuantizeLinear`` for ``torch.onnx.export``'s
``custom_translation_table``. Which formats have an ONNX form is data:
:data:`QDQ_SCHEMES`.

Measured (torch 2.13, onnxscript 0.7, onnxruntime 1.32 CPU): the dynamo exporter keeps
FLOAT8E4M3FN and INT8 initializers, drops the float weights the graph no longer reads,
and onnxruntime runs ``DequantizeLinear`` of both and ``QuantizeLinear`` to
FLOAT8E4M3FN with ``saturate=1``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from exportlm.quant import QuantizedTensor, dequantize, get_format, quantize_tensor

__all__ = ["QDQ_SCHEMES", "QDQScheme", "qdq_ops", "translation_table"]


@dataclass(frozen=True)
class QDQScheme:
    """How one quantization format is written in an ONNX graph.

    Attributes:
        format: the format's registry name (``"fp8"``).
        recipe: the :func:`~exportlm.quant.quantize` recipe that produces it (``"fp8"``).
        onnx_dtype: the ``onnx.TensorProto`` element type of the stored codes.
        axis: ``None`` for one scale per tensor, else the ``DequantizeLinear`` axis of
            the per-channel scales (``0``: one per output row).
        min_opset: the first ONNX opset whose ``DequantizeLinear`` takes ``onnx_dtype``.
        activations: the format can also quantize activations (static ``input_scale``).
    """

    format: str
    recipe: str
    onnx_dtype: str
    axis: int | None
    min_opset: int
    activations: bool = False


#: The formats the ``onnx`` target writes as quantized initializers, by format name.
QDQ_SCHEMES: dict[str, QDQScheme] = {
    scheme.format: scheme
    for scheme in (
        # FLOAT8E4M3FN entered DequantizeLinear / QuantizeLinear in opset 19.
        QDQScheme("fp8", "fp8", "FLOAT8E4M3FN", axis=None, min_opset=19, activations=True),
        # Per-axis DequantizeLinear of INT8 exists since opset 13.
        QDQScheme("int8", "int8_wo", "INT8", axis=0, min_opset=13),
    )
}


def _dequantize_eager(codes: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """The format's dequantize kernel on stored ``codes`` (unpacked formats only), float32."""
    q = QuantizedTensor(fmt, codes, scale, shape=tuple(codes.shape), dtype=torch.float32)
    return get_format(fmt).dequantize(q).to(torch.float32)


def _fake_quantize_eager(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``dequantize(quantize(x))`` with the per-tensor ``scale``, as the quantizer computes it."""
    q = quantize_tensor(x, fmt, scale=scale, where="onnx activation")
    return dequantize(q, torch.float32)


@functools.cache
def qdq_ops() -> tuple[Any, Any]:
    """The custom ops ``(exportlm::dequantize, exportlm::fake_quantize)``, defined once.

    Defined on first use (not at import), so importing the ``onnx`` target adds
    nothing to torch's op registry until a quantized model is exported.
    """

    @torch.library.custom_op("exportlm::dequantize", mutates_args=())
    def dequantize_op(codes: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
        return _dequantize_eager(codes, scale, fmt)

    @dequantize_op.register_fake
    def _dequantize_fake(codes: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
        return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)

    @torch.library.custom_op("exportlm::fake_quantize", mutates_args=())
    def fake_quantize_op(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
        return _fake_quantize_eager(x, scale, fmt)

    @fake_quantize_op.register_fake
    def _fake_quantize_fake(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
        return torch.empty_like(x, dtype=torch.float32)

    return dequantize_op, fake_quantize_op


def translation_table(opset: int) -> dict[Any, Callable[..., Any]]:
    """``custom_translation_table`` entries of ``torch.onnx.export`` for the two ops, at ``opset``."""
    import numpy as np
    import onnx
    import onnxscript
    from onnxscript import ir

    op = onnxscript.values.Opset("", opset)

    def dequantize_onnx(codes: Any, scale: Any, fmt: str) -> Any:
        axis = QDQ_SCHEMES[fmt].axis
        return op.DequantizeLinear(codes, scale, axis=0 if axis is None else axis)

    def fake_quantize_onnx(x: Any, scale: Any, fmt: str) -> Any:
        code_type = ir.DataType(getattr(onnx.TensorProto, QDQ_SCHEMES[fmt].onnx_dtype))
        # The zero point's element type selects QuantizeLinear's output type (opset 19-20).
        zero = op.Constant(value=ir.tensor(np.zeros((), dtype=code_type.numpy())))
        codes = op.QuantizeLinear(x, scale, zero, saturate=1)
        return op.DequantizeLinear(codes, scale)

    qdq_ops()  # defines torch.ops.exportlm.* when not yet done
    return {
        torch.ops.exportlm.dequantize.default: dequantize_onnx,
        torch.ops.exportlm.fake_quantize.default: fake_quantize_onnx,
    }
