"""The types every format shares: format names, the quantized tensor, safe scales.

This module sits below the format specs (:mod:`exportlm.quant.formats`): the
numeric kernels build :class:`QuantizedTensor` objects and derive their scales
with :func:`safe_scale`, and the generic :func:`~exportlm.quant.quantize_tensor` /
:func:`~exportlm.quant.dequantize` look the format up in the registry.

The two members here that need a format's spec (``QuantFormat.maxbound`` and
``QuantizedTensor.dequantize``) read it through :func:`install_format_lookup`:
the registry passes its lookup in when it is built, so this module imports
nothing of the registry or the specs above it (they import this module).

Safe scales: an amax of zero (an all-zero tensor, an activation that was
always zero) gives the scale ``1.0`` (logged at debug level), so no scale is
ever zero and no division makes an inf or NaN; a NaN or infinite amax raises
:class:`~exportlm.errors.QuantizationError` naming the quantizer.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from exportlm.errors import QuantizationError, UnsupportedFormatError

__all__ = [
    "CHUNK_ELEMENTS",
    "FP4_MAX",
    "FP8_MAX",
    "INT4_MAX",
    "INT8_MAX",
    "FormatId",
    "FormatKernels",
    "QuantFormat",
    "QuantizedTensor",
    "ScaleConvention",
    "abs_max",
    "format_name",
    "global_scale",
    "install_format_lookup",
    "safe_scale",
    "split_blocks",
]

logger = logging.getLogger(__name__)

#: Elements of one slice of rows that fake quantization, INT4 quantization and the AWQ
#: weight statistic work on at a time: 512 KiB of float32 per temporary, below the 1 MiB
#: from which the streaming export maps each allocation on its own, so the slices'
#: temporaries reuse the same heap memory. Read at call time (``_tensor.CHUNK_ELEMENTS``).
CHUNK_ELEMENTS = 1 << 17

#: How a recipe computes and stores its scales (the ``scales`` recipe option):
#: ``"modelopt"`` (float32 scales; NVFP4's second level ``amax / (6 * 448)``, multiplied)
#: or ``"compressed-tensors"`` (NVFP4's global scale ``6 * 448 / amax``, divided by, and
#: the other float scales in the dtype of the module's weight, as llm-compressor writes them).
ScaleConvention = Literal["modelopt", "compressed-tensors"]

#: Largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: Largest E2M1 (FP4) value.
FP4_MAX = 6.0
#: Symmetric int4 bound used for the scale (codes are clamped to [-8, 7]).
INT4_MAX = 7.0
#: Symmetric int8 bound used for the scale (codes are clamped to [-128, 127]).
INT8_MAX = 127.0


class QuantFormat(str, enum.Enum):
    """A built-in numeric format a :class:`~exportlm.quant.TensorQuantizer` quantizes to.

    Formats added with :func:`~exportlm.quant.register_format` are named by plain
    strings; everything that takes a format takes either (see :data:`FormatId`).
    """

    FP8 = "fp8"
    NVFP4 = "nvfp4"
    INT4 = "int4"
    INT8 = "int8"

    @property
    def maxbound(self) -> float:
        """The largest representable magnitude used to derive the scale."""
        return _spec_of(self).maxbound

    def __str__(self) -> str:
        return self.value


#: A format as the API takes it: a :class:`QuantFormat` member or a registered format's name.
FormatId = QuantFormat | str


def format_name(fmt: FormatId) -> str:
    """The registry name of ``fmt`` (``QuantFormat.FP8`` and ``"fp8"`` give ``"fp8"``)."""
    return fmt.value if isinstance(fmt, QuantFormat) else str(fmt)


@dataclass(frozen=True)
class QuantizedTensor:
    """The real (exported) form of one tensor.

    Attributes:
        format: the numeric format (a :class:`QuantFormat` member for the built-ins,
            the registered name otherwise).
        data: the stored codes (layout per format, see :mod:`exportlm.quant.formats`).
        scale: the scale tensor written as ``weight_scale`` / ``input_scale``.
        scale_2: NVFP4's per-tensor second-level scale (``weight_scale_2``), else ``None``.
        block_size: NVFP4 block / INT4 group size along the last dimension, else ``None``.
        shape: the shape of the original (unpacked) tensor.
        dtype: the dtype of the original tensor; :func:`~exportlm.quant.dequantize` returns it.
        scale_2_divides: ``scale_2`` is compressed-tensors' global scale (``6 * 448 / amax``):
            the block scales are divided by it, not multiplied (``False``: ModelOpt's
            ``weight_scale_2``). Neither is the exact reciprocal of the other in float32.
    """

    format: FormatId
    data: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor | None = None
    block_size: int | None = None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    scale_2_divides: bool = False

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized tensor (see :func:`~exportlm.quant.dequantize`)."""
        return _spec_of(self.format).dequantize(self).to(dtype or self.dtype)


class FormatKernels(Protocol):
    """What this module reads of a registered format (a :class:`~exportlm.quant.FormatSpec`)."""

    @property
    def maxbound(self) -> float: ...

    @property
    def dequantize(self) -> Callable[[QuantizedTensor], torch.Tensor]: ...


#: The registry's lookup, passed in by :mod:`exportlm.quant.formats` when it is built
#: (importing any part of :mod:`exportlm.quant` builds it first).
_FORMAT_LOOKUP: list[Callable[[FormatId], FormatKernels]] = []


def install_format_lookup(lookup: Callable[[FormatId], FormatKernels]) -> None:
    """Make ``lookup`` (the format registry's ``get_format``) the one this module reads."""
    _FORMAT_LOOKUP[:] = [lookup]


def _spec_of(fmt: FormatId) -> FormatKernels:
    if not _FORMAT_LOOKUP:  # unreachable through the package: its __init__ builds the registry
        raise RuntimeError("exportlm.quant.formats is not imported: no format registry yet")
    return _FORMAT_LOOKUP[0](fmt)


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
    # Divide by a tensor on amax's device, never by a Python number: CUDA computes
    # ``tensor / python_scalar`` as ``tensor * (1 / scalar)`` (two roundings), the CPU
    # as one correctly rounded division, so the scale's last bit would differ by device.
    scale = amax32 / amax32.new_tensor(divisor)
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


def global_scale(amax: torch.Tensor, divisor: float, *, where: str) -> torch.Tensor:
    """compressed-tensors' global scale ``divisor / amax`` in float32, as it computes it.

    The same expression as compressed-tensors' ``generate_gparam`` (a Python float over
    a tensor: ``amax.reciprocal() * divisor`` in torch), an amax floored at the smallest
    normal float32, an infinity (an all-zero tensor) replaced by 1.0. A NaN or infinite
    amax raises :class:`QuantizationError` naming ``where``, as :func:`safe_scale` does.
    """
    safe_scale(amax, divisor, where=where)  # the same refusal of a non-finite amax
    amax32 = amax.detach().to(torch.float32)
    amax32 = torch.clamp(amax32, min=torch.finfo(torch.float32).tiny)
    scale = divisor / amax32
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0)


def scaled_quotient(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in float32, rounded to the scale's dtype first where that is a half float.

    compressed-tensors divides a half-precision weight by its scale in that dtype (torch
    computes the float32 quotient and rounds it once), and rounds that to the code: its
    INT8 codes differ from the float32 quotient's in about 9% of a bfloat16 weight's values.
    """
    quotient = x.detach().to(torch.float32) / scale.to(torch.float32)
    if scale.dtype in (torch.bfloat16, torch.float16):
        return quotient.to(scale.dtype).to(torch.float32)
    return quotient


def split_blocks(x: torch.Tensor, block: int, fmt: str, where: str) -> torch.Tensor:
    """``x`` in float32 as ``[..., in / block, block]``; refuses a last dim not divisible."""
    if x.shape[-1] % block:
        raise UnsupportedFormatError(
            f"{where}: {fmt} needs the last dimension divisible by {block}, got shape "
            f"{tuple(x.shape)}; exclude the module or choose another format"
        )
    return x.detach().to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _describe(t: torch.Tensor) -> str:
    if t.numel() == 1:
        return f"{t.item()}"
    return f"{int((~torch.isfinite(t)).sum())} of {t.numel()} values non-finite"


def abs_max(x: torch.Tensor, axis: int | None) -> torch.Tensor:
    """``max |x|`` in float32: of the whole tensor, or per index of ``axis``.

    Stacked experts (``[E, out, in]``, one value or one per expert) one expert at a time:
    the same values (a max is exact in any order) with one expert's ``|x|`` alive, not the
    stack's (what a streamed MoE layer's calibration peaked on, docs/streaming.md).
    """
    if by_expert(x, axis):
        return experts_abs_max(x.__getitem__, x.shape[0], axis)
    x = x.abs()
    if axis is None:
        return x.amax().to(torch.float32)
    dims = [d for d in range(x.dim()) if d != axis % x.dim()]
    return (x.amax(dim=dims) if dims else x).to(torch.float32)


def by_expert(x: torch.Tensor, axis: int | None) -> bool:
    """Whether :func:`abs_max` takes the max of ``x`` one expert at a time: stacked experts
    ``[E, out, in]`` with one amax or one per expert (``axis`` 0)."""
    return x.dim() == 3 and 2 <= x.shape[0] <= 512 and (axis is None or axis % 3 == 0)


def experts_abs_max(
    expert: Callable[[int], torch.Tensor], count: int, axis: int | None
) -> torch.Tensor:
    """:func:`abs_max` of the stack of ``expert(0) ... expert(count - 1)`` (where
    :func:`by_expert`), one expert alive at a time: of the whole, or one per expert."""
    per_expert = torch.stack([expert(e).abs().amax() for e in range(count)])
    return (per_expert if axis is not None else per_expert.amax()).to(torch.float32)
