"""NVFP4: E2M1 codes in blocks of 16 with float8 block scales and an fp32 second level.

``weight`` uint8 ``[out, in / 2]`` (two E2M1 codes per byte, the even column in
the low nibble); ``weight_scale`` float8_e4m3fn ``[out, in / 16]``
``= block_amax / (6 * weight_scale_2)``; ``weight_scale_2`` fp32 0-d
``= amax / (6 * 448)``. ModelOpt's ``NVFP4_DEFAULT_CFG`` (weights and inputs).

compressed-tensors (``nvfp4-pack-quantized``) stores the same codes as
``weight_packed`` and the same block scales, and the reciprocals of the second
levels as ``weight_global_scale`` / ``input_global_scale`` (:mod:`~exportlm.quant.formats._ct_codecs`).
"""

from __future__ import annotations

import torch

from exportlm.errors import UnsupportedFormatError
from exportlm.quant._tensor import FP4_MAX, FP8_MAX, QuantFormat, QuantizedTensor, split_blocks
from exportlm.quant.formats._ct_codecs import nvfp4_codec
from exportlm.quant.formats._parts import (
    CompressedTensorsScheme,
    Leaf,
    ModelOptScheme,
)
from exportlm.quant.formats._spec import FormatSpec

__all__ = ["E2M1_VALUES", "NVFP4"]

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
# compressed-tensors' replacement of a zero float8 block scale (``_get_dtype_eps``).
_CT_ZERO_SCALE = 0.125


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    scale: torch.Tensor | None,
    block_size: int | None,
    where: str,
    divides: bool = False,
) -> QuantizedTensor:
    """E2M1 codes with float8 block scales; ``scale`` is the second level.

    ``divides=False``: ModelOpt's ``weight_scale_2`` (``amax / (6 * 448)``), block scale
    ``block_amax / (6 * scale)``, applied as ``block scale * scale``. ``divides=True``:
    compressed-tensors' global scale (``6 * 448 / amax``), block scale
    ``scale * (block_amax / 6)``, applied as ``block scale / scale``
    (:func:`_ct_block_scales`).
    """
    if scale is None or not block_size:
        raise ValueError(f"{where}: nvfp4 quantization needs the per-tensor scale and a block_size")
    if x.shape[-1] % 2:
        raise UnsupportedFormatError(f"{where}: nvfp4 packs pairs, got odd shape {tuple(x.shape)}")
    blocks = split_blocks(x, block_size, "nvfp4", where)
    # 0-d, or [E, 1, 1] for stacked experts: broadcasts over the blocks. On x's device:
    # CUDA divides by a CPU scalar through its reciprocal (another last bit).
    s2 = scale.to(x.device)
    if divides:
        scale_fp8, effective = _ct_block_scales(blocks, s2, x.dtype)
    else:
        scale_fp8 = _modelopt_block_scales(blocks, s2)
        effective = scale_fp8.to(torch.float32) * s2
    scaled = blocks / effective.unsqueeze(-1)
    codes = _e2m1_codes(scaled.reshape(x.shape))
    packed = (codes[..., 1::2] << 4) | codes[..., 0::2]
    return QuantizedTensor(
        QuantFormat.NVFP4, packed, scale_fp8, scale, block_size, tuple(x.shape), x.dtype, divides
    )


def _modelopt_block_scales(blocks: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """ModelOpt's float8 block scales ``block_amax / (6 * s2)`` (a zero block: 1.0)."""
    block_scale = blocks.abs().amax(dim=-1) / (FP4_MAX * s2)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    rounded = block_scale.to(torch.float8_e4m3fn).to(torch.float32)
    # A block scale that underflows float8 would divide by zero: floor it at the
    # smallest subnormal (the block's values still fit, |x| / scale < 3). Chosen in
    # float32 on x's device (2**-9 is exact in float8), so no device mixes in.
    floor = torch.full_like(rounded, _FP8_MIN_SUBNORMAL)
    return torch.where(rounded == 0, floor, rounded).to(torch.float8_e4m3fn)


def _ct_block_scales(
    blocks: torch.Tensor, gs: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' float8 block scales and the effective scales they stand for.

    As ``calculate_qparams`` computes them: ``gs * (block_amax / 6)``, the division in
    the tensor's own ``dtype`` (its observer's min / max are of that dtype; a division by
    a tensor, so no device multiplies by a rounded 1/6), clamped to the float8 range
    and rounded, a zero replaced by its ``0.125``; applied as ``block scale / gs``.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        dtype = torch.float32
    bamax = blocks.abs().amax(dim=-1).to(dtype)  # exact: a max of values of that dtype
    local = (bamax / bamax.new_tensor(FP4_MAX)).to(torch.float32)
    rounded = torch.clamp(gs * local, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    rounded = torch.where(rounded == 0, torch.full_like(rounded, _CT_ZERO_SCALE), rounded)
    return rounded.to(torch.float8_e4m3fn), rounded / gs


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even, saturating at 6) as 4-bit codes."""
    sign = (v < 0).to(torch.uint8)
    mag = v.abs()
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=mag.dtype, device=mag.device)
    code = torch.searchsorted(bounds, mag.contiguous()).to(torch.uint8)
    tie_up = torch.zeros_like(mag, dtype=torch.bool)
    for b in _E2M1_TIE_UP:
        tie_up |= mag == b
    return (sign << 3) | (code + tie_up.to(torch.uint8))


def dequantize_nvfp4(q: QuantizedTensor) -> torch.Tensor:
    """E2M1 values times ``block scale * scale_2`` (``block scale / scale_2`` where
    :attr:`~exportlm.quant.QuantizedTensor.scale_2_divides`), float32."""
    if q.scale_2 is None or q.block_size is None:
        raise ValueError("an nvfp4 QuantizedTensor needs scale_2 and block_size")
    codes = torch.stack((q.data & 0x0F, q.data >> 4), dim=-1).reshape(q.shape)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]
    s2 = q.scale_2.to(torch.float32)
    block_scale = (
        q.scale.to(torch.float32) / s2 if q.scale_2_divides else q.scale.to(torch.float32) * s2
    )
    blocks = values.reshape(*q.shape[:-1], -1, q.block_size) * block_scale.unsqueeze(-1)
    return blocks.reshape(q.shape)


_MODELOPT_ARGS = {"dynamic": False, "num_bits": 4, "type": "float"}
# compressed-tensors' NVFP4 preset as it serializes it (llm-compressor's scheme="NVFP4")
_CT_WEIGHTS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": 16,
    "strategy": "tensor_group",
    "dynamic": False,
    "scale_dtype": "torch.float8_e4m3fn",
}
_CT_INPUTS = {**_CT_WEIGHTS, "dynamic": "local", "observer": "static_minmax"}

NVFP4 = FormatSpec(
    format=QuantFormat.NVFP4,
    quantize=quantize_nvfp4,
    dequantize=dequantize_nvfp4,
    maxbound=FP4_MAX,
    amax_divisor=FP4_MAX * FP8_MAX,
    granularity="block",
    leaves=(
        Leaf("weight", torch.uint8, source="data"),
        Leaf("weight_scale", torch.float8_e4m3fn, source="scale"),
        Leaf("weight_scale_2", torch.float32, source="scale_2"),
        Leaf("input_scale", torch.float32, role="activation"),
    ),
    calibrated=True,
    packing=2,
    packed_dim=-1,
    block_size=16,
    activations=QuantFormat.NVFP4,
    modelopt=ModelOptScheme("NVFP4", weights=_MODELOPT_ARGS, input_activations=_MODELOPT_ARGS),
    compressed_tensors=CompressedTensorsScheme(
        "nvfp4-pack-quantized",
        weights=_CT_WEIGHTS,
        input_activations=_CT_INPUTS,
        codec=nvfp4_codec(),
    ),
    share_fused_weight_amax=True,
    global_scale=True,
)
