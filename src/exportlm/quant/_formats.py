"""Real quantization and dequantization of one tensor, in any registered format.

:func:`quantize_tensor` derives the per-tensor scale of a calibrated format from
``amax`` (safely: see :func:`safe_scale`) and hands the tensor to the format's
kernel; :func:`dequantize` calls the format's inverse kernel. The formats, their
layouts and kernels are data in :mod:`exportlm.quant.formats`.
"""

from __future__ import annotations

import torch

from exportlm.quant._tensor import (
    FP4_MAX,
    FP8_MAX,
    INT4_MAX,
    INT8_MAX,
    FormatId,
    QuantFormat,
    QuantizedTensor,
    safe_scale,
)
from exportlm.quant.formats import E2M1_VALUES, get_format

__all__ = [
    "E2M1_VALUES",
    "FP4_MAX",
    "FP8_MAX",
    "INT4_MAX",
    "INT8_MAX",
    "QuantFormat",
    "QuantizedTensor",
    "dequantize",
    "quantize_tensor",
    "safe_scale",
]


def quantize_tensor(
    x: torch.Tensor,
    fmt: FormatId,
    *,
    amax: torch.Tensor | None = None,
    block_size: int | None = None,
    where: str = "tensor",
    scale: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` (last dimension = input features) to ``fmt``.

    ``amax`` is the calibrated per-tensor amax of a calibrated format (FP8; the
    global amax of NVFP4), 0-d or ``[E, 1, 1]`` for stacked experts ``[E, out, in]``;
    it defaults to ``max |x|``. Other formats (INT4 per group of ``block_size``,
    INT8 per row) derive their scales from ``x`` and ignore it. ``scale`` replaces
    ``amax`` with the per-tensor scale itself (FP8 ``scale``, NVFP4 ``scale_2``),
    used as it is: a scale read back from a checkpoint (not every float32 scale
    is ``amax / maxbound`` of some float32 amax).

    Raises :class:`~exportlm.errors.UnknownNameError` for an unregistered format,
    ``ValueError`` when a block format gets no ``block_size``, and
    :class:`~exportlm.errors.UnsupportedFormatError` for a shape the format cannot take.
    """
    spec = get_format(fmt)
    block: int | None = None
    if spec.needs_block:
        if not block_size:
            raise ValueError(f"{spec.format} quantization needs a block_size")
        block = block_size
    per_tensor = None
    if spec.calibrated:
        per_tensor = _per_tensor_scale(x, amax, scale, spec.amax_divisor, where)
    return spec.quantize(x, scale=per_tensor, block_size=block, where=where)


def _per_tensor_scale(
    x: torch.Tensor,
    amax: torch.Tensor | None,
    scale: torch.Tensor | None,
    divisor: float,
    where: str,
) -> torch.Tensor:
    """``scale`` as given, else ``safe_scale(amax)`` (``amax`` defaults to ``max |x|``)."""
    if scale is not None:
        return scale.detach().to(torch.float32)
    if amax is None:
        amax = x.detach().abs().amax().float()
    return safe_scale(amax, divisor, where=where)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The float tensor ``q`` stands for, in ``dtype`` (default: the original dtype).

    This is exactly what the fake-quantized model computes with, so for every
    format ``dequantize(quantize_tensor(x, ...))`` equals the fake-quantized ``x``.
    """
    return q.dequantize(dtype)
