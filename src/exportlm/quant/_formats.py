"""Real quantization and dequantization of one tensor, in any registered format.

:func:`quantize_tensor` derives the per-tensor scale of a calibrated format from
``amax`` (safely: see :func:`safe_scale`) and hands the tensor to the format's
kernel; :func:`dequantize` calls the format's inverse kernel. The formats, their
layouts and kernels are data in :mod:`exportlm.quant.formats`.
"""

from __future__ import annotations

import torch

from exportlm.errors import QuantizationError
from exportlm.quant import _tensor
from exportlm.quant._tensor import (
    FP4_MAX,
    FP8_MAX,
    INT4_MAX,
    INT8_MAX,
    FormatId,
    QuantFormat,
    QuantizedTensor,
    safe_scale,
    split_blocks,
)
from exportlm.quant.formats import E2M1_VALUES, FormatSpec, formats, get_format

__all__ = [
    "E2M1_VALUES",
    "FP4_MAX",
    "FP8_MAX",
    "INT4_MAX",
    "INT8_MAX",
    "QuantFormat",
    "QuantizedTensor",
    "convention_scale",
    "dequantize",
    "quantize_tensor",
    "row_chunks",
    "safe_scale",
    "static_scale_value",
]


_HALF = (torch.bfloat16, torch.float16)


def quantize_tensor(
    x: torch.Tensor,
    fmt: FormatId,
    *,
    amax: torch.Tensor | None = None,
    block_size: int | None = None,
    where: str = "tensor",
    scale: torch.Tensor | None = None,
    divides: bool = False,
) -> QuantizedTensor:
    """Quantize ``x`` (last dimension = input features) to ``fmt``.

    ``amax`` is the calibrated per-tensor amax of a calibrated format (FP8; the
    global amax of NVFP4), 0-d or ``[E, 1, 1]`` for stacked experts ``[E, out, in]``;
    it defaults to ``max |x|``. Other formats (INT4 per group of ``block_size``,
    INT8 per row) derive their scales from ``x`` and ignore it. ``scale`` replaces
    ``amax`` with the per-tensor scale itself (FP8 ``scale``, NVFP4 ``scale_2``),
    used as it is: a scale read back from a checkpoint (not every float32 scale
    is ``amax / maxbound`` of some float32 amax). A ``scale`` in bfloat16 / float16
    is kept in that dtype (the scales of the ``compressed-tensors`` convention for a
    half-precision weight: the codes are those of its float32 value, the dtype says
    how it is stored). ``divides``: ``scale`` is compressed-tensors' global scale of a
    format that has one (NVFP4, :attr:`~exportlm.quant.formats.FormatSpec.global_scale`).

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
    elif scale is not None:  # a row / group format's scales, given (convention_scale)
        per_tensor = scale.detach()
    if divides:
        if not spec.global_scale or scale is None:
            raise ValueError(
                f"{where}: divides=True takes a given global scale of a format that has one "
                f"(NVFP4); {spec.format} has none"
            )
        return spec.quantize(x, scale=per_tensor, block_size=block, where=where, divides=True)  # type: ignore[call-arg]
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
        scale = scale.detach()
        return scale if scale.dtype in _HALF else scale.to(torch.float32)
    if amax is None:
        amax = x.detach().abs().amax().float()
    return safe_scale(amax, divisor, where=where)


def convention_scale(
    x: torch.Tensor,
    spec: FormatSpec,
    block_size: int | None,
    dtype: torch.dtype | None,
    where: str,
) -> torch.Tensor | None:
    """compressed-tensors' weight scales of ``x`` in ``spec``'s row / group format, or ``None``
    where its scheme has no :attr:`~exportlm.quant.formats.CompressedTensorsScheme.scale_divisor`.

    ``amax / divisor`` per row (per group of ``block_size`` along the last dimension) in
    float32, rounded once to ``dtype`` (the half-precision weight's; ``None``: float32), as
    compressed-tensors' ``calculate_qparams`` computes them from a min-max observer; a zero
    scale (an all-zero row) is that dtype's ``eps``, as it stores one. The codes are then
    the rounding of the quotient in that dtype (:func:`~exportlm.quant._tensor.scaled_quotient`).
    """
    scheme = spec.compressed_tensors
    divisor = None if scheme is None else scheme.scale_divisor
    if divisor is None:
        return None
    rows = x.detach()
    amax = (split_blocks(rows, block_size, spec.name, where) if block_size else rows).abs().amax(-1)
    scale = safe_scale(amax, divisor, where=where)
    scale = scale if dtype is None else scale.to(dtype)
    return torch.where(amax == 0, torch.finfo(scale.dtype).eps, scale)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The float tensor ``q`` stands for, in ``dtype`` (default: the original dtype).

    This is exactly what the fake-quantized model computes with, so for every
    format ``dequantize(quantize_tensor(x, ...))`` equals the fake-quantized ``x``.
    """
    return q.dequantize(dtype)


def row_chunks(shape: tuple[int, ...] | torch.Size, spec: FormatSpec) -> list[slice]:
    """Slices of the rows of a 2-D ``shape`` that ``spec`` quantizes independently.

    Quantizing (and dequantizing) each slice alone gives the same values as the whole
    tensor when every scale is the per-tensor one given from a calibrated amax, or one
    per row / per block of the last dimension (:attr:`FormatSpec.granularity
    <exportlm.quant.formats.FormatSpec.granularity>`); slices of a format packed along
    the rows keep whole pairs. A per-tensor scale derived from the tensor itself (an
    uncalibrated ``"tensor"`` format) needs the whole tensor: one slice then. The
    slices are about :data:`~exportlm.quant._tensor.CHUNK_ELEMENTS` each, so the float32 temporaries of a
    fake quantization are those of one slice, not of a weight-sized copy.
    """
    if len(shape) != 2 or not (spec.calibrated or spec.granularity in ("row", "block")):
        return [slice(None)]
    rows, cols = int(shape[0]), max(int(shape[1]), 1)
    pair = spec.packing if spec.packed_dim == -2 else 1
    step = max(pair, _tensor.CHUNK_ELEMENTS // cols // pair * pair)
    if step >= rows:
        return [slice(None)]
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def static_scale_value(scale: torch.Tensor, spec: FormatSpec, where: str) -> torch.Tensor:
    """``scale`` as a 0-d static activation scale of format ``spec``: float32, or the half
    float it is stored in (a compressed-tensors checkpoint of a half-precision model).

    Raises :class:`QuantizationError` for a scale that is not a single finite,
    positive number, or a weight-only format (one whose spec is not ``calibrated``,
    e.g. INT4 / INT8: activations are FP8 or NVFP4).
    """
    if not spec.calibrated:
        static = " or ".join(str(s.format).upper() for s in formats() if s.calibrated)
        raise QuantizationError(
            f"{where}: static activation scales are {static}, got {spec.format}; "
            f"{spec.format} quantizes weights only"
        )
    value = scale.detach().to(torch.float32)
    if value.numel() != 1 or not bool(torch.isfinite(value).all()) or float(value) <= 0:
        raise QuantizationError(
            f"{where}: an exported activation scale must be one finite positive number, "
            f"got shape {tuple(scale.shape)} value(s) {value.flatten()[:4].tolist()}; "
            "the checkpoint is corrupt or was not written by a per-tensor exporter"
        )
    return (scale.detach() if scale.dtype in _HALF else value).reshape(())
