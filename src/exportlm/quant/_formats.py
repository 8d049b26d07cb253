"""Numeric formats: real quantization, dequantization and safe scales.

Every fake-quantization in :mod:`exportlm.quant` is ``dequantize(quantize(x))``
with the functions of this module, and every exporter writes what
``quantize`` returns. That is what makes the fake-quantized model and the
dequantized checkpoint agree bit for bit.

Layouts (NVIDIA ModelOpt's, which vLLM, SGLang and TensorRT-LLM read):

========  ============================  ===========================================
format    ``data``                       scales
========  ============================  ===========================================
fp8       float8_e4m3fn ``[out, in]``    ``scale`` fp32 0-d ``= amax / 448``
nvfp4     uint8 ``[out, in / 2]``: two   ``scale`` float8_e4m3fn ``[out, in / 16]``
          E2M1 codes per byte, even      ``= block_amax / (6 * scale_2)``;
          column in the low nibble       ``scale_2`` fp32 0-d ``= amax / (6 * 448)``
int4      uint8 ``[out / 2, in]``: two   ``scale`` fp32 ``[out, in / group]``
          int4 per byte, even row in     ``= group_amax / 7``
          the low nibble
int8      int8 ``[out, in]``             ``scale`` fp32 ``[out] = row_amax / 127``
========  ============================  ===========================================

Safe scales: an amax of zero (an all-zero tensor, an activation that was
always zero) gives the scale ``1.0`` (logged at debug level), so no scale is
ever zero and no division makes an inf or NaN; a NaN or infinite amax raises
:class:`~exportlm.errors.QuantizationError` naming the quantizer.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

from exportlm.errors import QuantizationError, UnsupportedFormatError

__all__ = [
    "E2M1_VALUES",
    "FP8_MAX",
    "FP4_MAX",
    "INT4_MAX",
    "INT8_MAX",
    "QuantFormat",
    "QuantizedTensor",
    "dequantize",
    "quantize_tensor",
    "safe_scale",
]

logger = logging.getLogger(__name__)

#: Largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: Largest E2M1 (FP4) value.
FP4_MAX = 6.0
#: Symmetric int4 bound used for the scale (codes are clamped to [-8, 7]).
INT4_MAX = 7.0
#: Symmetric int8 bound used for the scale (codes are clamped to [-128, 127]).
INT8_MAX = 127.0

#: The 16 E2M1 values by 4-bit code (bit 3 is the sign).
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
# Midpoints between consecutive E2M1 magnitudes; a tie rounds to the even code.
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (0.75, 1.75, 3.5)  # ties whose upper neighbour has the even code
# Smallest positive float8_e4m3fn (subnormal): a block scale never goes below it.
_FP8_MIN_SUBNORMAL = 2.0**-9


class QuantFormat(str, enum.Enum):
    """A numeric format a :class:`~exportlm.quant.TensorQuantizer` quantizes to."""

    FP8 = "fp8"
    NVFP4 = "nvfp4"
    INT4 = "int4"
    INT8 = "int8"

    @property
    def maxbound(self) -> float:
        """The largest representable magnitude used to derive the scale."""
        return _MAXBOUND[self]

    def __str__(self) -> str:
        return self.value


_MAXBOUND = {
    QuantFormat.FP8: FP8_MAX,
    QuantFormat.NVFP4: FP4_MAX,
    QuantFormat.INT4: INT4_MAX,
    QuantFormat.INT8: INT8_MAX,
}


@dataclass(frozen=True)
class QuantizedTensor:
    """The real (exported) form of one tensor.

    Attributes:
        format: the numeric format.
        data: the stored codes (layout per format, see the module docstring).
        scale: the scale tensor written as ``weight_scale`` / ``input_scale``.
        scale_2: NVFP4's per-tensor second-level scale (``weight_scale_2``), else ``None``.
        block_size: NVFP4 block / INT4 group size along the last dimension, else ``None``.
        shape: the shape of the original (unpacked) tensor.
        dtype: the dtype of the original tensor; :func:`dequantize` returns it.
    """

    format: QuantFormat
    data: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor | None = None
    block_size: int | None = None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized tensor (see :func:`dequantize`)."""
        return dequantize(self, dtype)


def safe_scale(amax: torch.Tensor, divisor: float, *, where: str) -> torch.Tensor:
    """``amax / divisor`` in float32, with a zero scale replaced by 1.0.

    Raises :class:`QuantizationError` naming ``where`` when ``amax`` holds a
    NaN or an infinity (a diverged calibration: there is no meaningful scale).
    """
    amax32 = amax.detach().to(torch.float32)
    if not bool(torch.isfinite(amax32).all()):
        raise QuantizationError(
            f"{where}: amax is not finite ({_describe(amax32)}); the calibration produced "
            "NaN or inf activations or weights. Fix the model or the calibration data, "
            "or exclude this module from quantization."
        )
    scale = amax32 / divisor
    zero = scale == 0
    if bool(zero.any()):
        logger.debug(
            "%s: %d zero amax value(s); using scale 1.0 there (an all-zero tensor "
            "quantizes to zeros with any scale)",
            where,
            int(zero.sum()),
        )
        scale = torch.where(zero, torch.ones_like(scale), scale)
    return scale


def _describe(t: torch.Tensor) -> str:
    if t.numel() == 1:
        return f"{t.item()}"
    return f"{int((~torch.isfinite(t)).sum())} of {t.numel()} values non-finite"


def quantize_tensor(
    x: torch.Tensor,
    fmt: QuantFormat,
    *,
    amax: torch.Tensor | None = None,
    block_size: int | None = None,
    where: str = "tensor",
    scale: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` (last dimension = input features) to ``fmt``.

    ``amax`` is the calibrated per-tensor amax for FP8 and the global amax for
    NVFP4 (0-d, or ``[E, 1, 1]`` for stacked experts ``[E, out, in]``);
    INT4 (per group of ``block_size``) and INT8 (per row) derive theirs from ``x``.
    ``scale`` replaces ``amax`` with the per-tensor scale itself (FP8 ``scale``,
    NVFP4 ``scale_2``), used as it is: a scale read back from a checkpoint
    (not every float32 scale is ``amax / maxbound`` of some float32 amax).
    """
    if fmt is QuantFormat.FP8:
        return _quantize_fp8(x, _per_tensor_scale(x, amax, scale, FP8_MAX, where), where)
    if fmt is QuantFormat.NVFP4:
        block = _require_block(block_size, fmt)
        scale_2 = _per_tensor_scale(x, amax, scale, FP4_MAX * FP8_MAX, where)
        return _quantize_nvfp4(x, scale_2, block, where)
    if fmt is QuantFormat.INT4:
        return _quantize_int4(x, _require_block(block_size, fmt), where)
    return _quantize_int8(x, where)


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


def _require_block(block_size: int | None, fmt: QuantFormat) -> int:
    if not block_size:
        raise ValueError(f"{fmt} quantization needs a block_size")
    return block_size


#: Elements per step of the chunked CPU FP8 cast: a 1 MiB float32 scratch that stays in cache.
_FP8_CHUNK = 1 << 18


def _quantize_fp8(x: torch.Tensor, scale: torch.Tensor, where: str) -> QuantizedTensor:
    x = x.detach()
    if (
        x.device.type == "cpu"
        and scale.numel() == 1
        and x.is_contiguous()
        and x.numel() > _FP8_CHUNK
    ):
        data = _fp8_codes_chunked(x, scale)
    else:
        data = (x.to(torch.float32) / scale).to(torch.float8_e4m3fn)
    return QuantizedTensor(QuantFormat.FP8, data, scale, shape=tuple(x.shape), dtype=x.dtype)


def _fp8_codes_chunked(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(x.float() / scale).to(float8_e4m3fn)`` through one small reused float32 scratch.

    The same elementwise float32 division and cast, so the same bytes; but no
    full-size float32 temporaries, whose fresh pages (zeroed by the kernel on
    first touch) cost more than the arithmetic on a large weight.
    """
    flat = x.reshape(-1)
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    codes = data.view(-1)
    scratch = torch.empty(_FP8_CHUNK, dtype=torch.float32)
    for start in range(0, flat.numel(), _FP8_CHUNK):
        chunk = flat[start : start + _FP8_CHUNK]
        buf = scratch[: chunk.numel()]
        if chunk.dtype == torch.float32:
            torch.div(chunk, scale, out=buf)
        else:  # widen first: a float32 0-d scale would not promote a bf16 chunk
            buf.copy_(chunk).div_(scale)
        codes[start : start + chunk.numel()].copy_(buf)
    return data


def _blocks(x: torch.Tensor, block: int, fmt: QuantFormat, where: str) -> torch.Tensor:
    if x.shape[-1] % block:
        raise UnsupportedFormatError(
            f"{where}: {fmt} needs the last dimension divisible by {block}, got shape "
            f"{tuple(x.shape)}; exclude the module or choose another format"
        )
    return x.detach().to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _quantize_nvfp4(
    x: torch.Tensor, scale_2: torch.Tensor, block: int, where: str
) -> QuantizedTensor:
    if x.shape[-1] % 2:
        raise UnsupportedFormatError(f"{where}: nvfp4 packs pairs, got odd shape {tuple(x.shape)}")
    blocks = _blocks(x, block, QuantFormat.NVFP4, where)
    s2 = scale_2  # 0-d, or [E, 1, 1] for stacked experts: broadcasts over the blocks
    block_scale = blocks.abs().amax(dim=-1) / (FP4_MAX * s2)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    scale_fp8 = block_scale.to(torch.float8_e4m3fn)
    # A block scale that underflows float8 would divide by zero: floor it at the
    # smallest subnormal (the block's values still fit, |x| / scale < 3).
    floor = torch.tensor(_FP8_MIN_SUBNORMAL).to(torch.float8_e4m3fn)
    scale_fp8 = torch.where(scale_fp8.to(torch.float32) == 0, floor, scale_fp8)
    scaled = blocks / (scale_fp8.to(torch.float32) * s2).unsqueeze(-1)
    codes = _e2m1_codes(scaled.reshape(x.shape))
    packed = (codes[..., 1::2] << 4) | codes[..., 0::2]
    return QuantizedTensor(
        QuantFormat.NVFP4, packed, scale_fp8, scale_2, block, tuple(x.shape), x.dtype
    )


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even, saturating at 6) as 4-bit codes."""
    sign = (v < 0).to(torch.uint8)
    mag = v.abs()
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=mag.dtype)
    code = torch.searchsorted(bounds, mag.contiguous()).to(torch.uint8)
    tie_up = torch.zeros_like(mag, dtype=torch.bool)
    for b in _E2M1_TIE_UP:
        tie_up |= mag == b
    return (sign << 3) | (code + tie_up.to(torch.uint8))


def _quantize_int4(x: torch.Tensor, group: int, where: str) -> QuantizedTensor:
    if x.dim() < 2 or x.shape[-2] % 2:
        raise UnsupportedFormatError(
            f"{where}: int4 packs pairs of rows (dim -2), got shape {tuple(x.shape)}"
        )
    groups = _blocks(x, group, QuantFormat.INT4, where)
    scale = safe_scale(groups.abs().amax(dim=-1), INT4_MAX, where=where)
    codes = (groups / scale.unsqueeze(-1)).round().clamp(-8, 7).to(torch.int8).reshape(x.shape)
    nibbles = (codes & 0x0F).to(torch.uint8)
    packed = nibbles[..., 0::2, :] | (nibbles[..., 1::2, :] << 4)
    return QuantizedTensor(QuantFormat.INT4, packed, scale, None, group, tuple(x.shape), x.dtype)


def _quantize_int8(x: torch.Tensor, where: str) -> QuantizedTensor:
    x32 = x.detach().to(torch.float32)
    scale = safe_scale(x32.abs().amax(dim=-1), INT8_MAX, where=where)
    codes = (x32 / scale.unsqueeze(-1)).round().clamp(-128, 127).to(torch.int8)
    return QuantizedTensor(QuantFormat.INT8, codes, scale, shape=tuple(x.shape), dtype=x.dtype)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The float tensor ``q`` stands for, in ``dtype`` (default: the original dtype).

    This is exactly what the fake-quantized model computes with, so for every
    format ``dequantize(quantize_tensor(x, ...))`` equals the fake-quantized ``x``.
    """
    out = dtype or q.dtype
    if q.format is QuantFormat.FP8:
        return (q.data.to(torch.float32) * q.scale).to(out)
    if q.format is QuantFormat.NVFP4:
        return _dequantize_nvfp4(q).to(out)
    if q.format is QuantFormat.INT4:
        low = (q.data & 0x0F).to(torch.int8)
        high = (q.data >> 4).to(torch.int8)
        codes = torch.stack((low, high), dim=-2).reshape(q.shape)
        codes = torch.where(codes > 7, codes - 16, codes).to(torch.float32)
        block = q.block_size or q.shape[-1]
        groups = codes.reshape(*q.shape[:-1], -1, block) * q.scale.unsqueeze(-1)
        return groups.reshape(q.shape).to(out)
    return (q.data.to(torch.float32) * q.scale.unsqueeze(-1)).to(out)


def _dequantize_nvfp4(q: QuantizedTensor) -> torch.Tensor:
    if q.scale_2 is None or q.block_size is None:
        raise ValueError("an nvfp4 QuantizedTensor needs scale_2 and block_size")
    codes = torch.stack((q.data & 0x0F, q.data >> 4), dim=-1).reshape(q.shape)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes.long()]
    block_scale = q.scale.to(torch.float32) * q.scale_2
    blocks = values.reshape(*q.shape[:-1], -1, q.block_size) * block_scale.unsqueeze(-1)
    return blocks.reshape(q.shape)
