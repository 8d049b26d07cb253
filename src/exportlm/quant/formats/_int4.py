"""INT4 AWQ (W4A16): symmetric int4 codes per group of 128 inputs, pairs of rows packed.

``weight`` uint8 ``[out / 2, in]`` (two int4 codes per byte, the even row in the
low nibble); ``weight_scale`` fp32 ``[out, in / group] = group_amax / 7``; the
AWQ ``pre_quant_scale`` fp32 ``[in]`` multiplies the input (activations stay float).

compressed-tensors stores the same codes and scales as ``pack-quantized`` (W4A16,
``strategy: group``): ``weight_packed`` int32 ``[out, in / 8]``, ``weight_scale``
``[out, in / group]``, ``weight_shape`` (:mod:`~exportlm.quant.formats._ct_codecs`).
"""

from __future__ import annotations

import torch

from exportlm.errors import UnsupportedFormatError
from exportlm.quant import _tensor
from exportlm.quant._tensor import (
    INT4_MAX,
    QuantFormat,
    QuantizedTensor,
    safe_scale,
    scaled_quotient,
    split_blocks,
)
from exportlm.quant.formats._ct_codecs import pack_quantized_codec
from exportlm.quant.formats._parts import (
    CompressedTensorsScheme,
    Leaf,
    ModelOptScheme,
)
from exportlm.quant.formats._spec import FormatSpec

__all__ = ["INT4"]


def quantize_int4(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """Round ``x / (group_amax / 7)`` to int4 (clamped to [-8, 7]); ``scale``: the group
    scales ``[out, in / group]`` to use instead (compressed-tensors' convention)."""
    if not block_size:
        raise ValueError(f"{where}: int4 quantization needs a block_size")
    if x.dim() < 2 or x.shape[-2] % 2:
        raise UnsupportedFormatError(
            f"{where}: int4 packs pairs of rows (dim -2), got shape {tuple(x.shape)}"
        )
    step = max(2, _tensor.CHUNK_ELEMENTS // max(x.shape[-1], 1) // 2 * 2)
    if x.dim() == 2 and x.shape[0] > step and x.shape[1] % block_size == 0:
        rows, cols = x.shape  # slices of rows: the same codes, small temporaries
        packed = torch.empty((rows // 2, cols), dtype=torch.uint8, device=x.device)
        group_scale = (
            torch.empty((rows, cols // block_size), dtype=torch.float32, device=x.device)
            if scale is None
            else scale
        )
        for start in range(0, rows, step):
            end = min(start + step, rows)
            given = None if scale is None else scale[start:end]
            packed[start // 2 : end // 2], group_scale[start:end] = _int4_codes(
                x[start:end], block_size, where, given
            )
    else:
        packed, group_scale = _int4_codes(x, block_size, where, scale)
    return QuantizedTensor(
        QuantFormat.INT4, packed, group_scale, None, block_size, tuple(x.shape), x.dtype
    )


def _int4_codes(
    x: torch.Tensor, block_size: int, where: str, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed codes and the group scales of ``x`` (an even number of rows); ``scale``:
    the group scales to use (their dtype's quotient: :func:`scaled_quotient`)."""
    groups = split_blocks(x, block_size, "int4", where)
    if scale is None:
        scale = safe_scale(groups.abs().amax(dim=-1), INT4_MAX, where=where)
    group_scale = scale
    codes = scaled_quotient(groups, group_scale.unsqueeze(-1)).round_().clamp_(-8, 7)
    codes = codes.to(torch.int8)
    return pack_int4_rows(codes.reshape(x.shape)), group_scale


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """Signed int4 ``codes`` (int8 ``[..., rows, cols]``) as bytes: pairs of rows, even row low."""
    nibbles = (codes & 0x0F).to(torch.uint8)
    return nibbles[..., 0::2, :] | (nibbles[..., 1::2, :] << 4)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """The signed int8 codes ``[..., 2 * rows, cols]`` of :func:`pack_int4_rows` bytes.

    Each nibble is sign-extended by an arithmetic shift of the byte seen as int8 (the
    low one shifted up first): two elementwise passes, 11x faster than masking,
    stacking and mapping ``> 7`` to negatives, which the AWQ search paid per candidate.
    """
    low = (packed << 4).view(torch.int8) >> 4
    high = packed.view(torch.int8) >> 4
    rows, cols = packed.shape[-2:]
    codes = torch.empty((*packed.shape[:-2], 2 * rows, cols), dtype=torch.int8)
    codes[..., 0::2, :] = low
    codes[..., 1::2, :] = high
    return codes


def dequantize_int4(q: QuantizedTensor) -> torch.Tensor:
    """Unpacked signed codes times their group scale, float32."""
    codes = unpack_int4_rows(q.data).reshape(q.shape).to(torch.float32)
    block = q.block_size or q.shape[-1]
    groups = codes.reshape(*q.shape[:-1], -1, block).mul_(q.scale.unsqueeze(-1))
    return groups.reshape(q.shape)


INT4 = FormatSpec(
    format=QuantFormat.INT4,
    quantize=quantize_int4,
    dequantize=dequantize_int4,
    maxbound=INT4_MAX,
    amax_divisor=INT4_MAX,
    granularity="block",
    leaves=(
        Leaf("weight", torch.uint8, source="data"),
        Leaf("weight_scale", torch.float32, source="scale"),
        Leaf("pre_quant_scale", torch.float32, role="activation"),
    ),
    packing=2,
    packed_dim=-2,
    # group_size=64 / 32 (recipe options) for input features not divisible by 128
    # (SmolLM2's 576, 960), as AutoAWQ, ModelOpt and llm-compressor take them
    block_size=128,
    modelopt=ModelOptScheme(
        "W4A16_AWQ",
        weights={"dynamic": False, "num_bits": 4, "type": "int"},
        layer_fields={"has_zero_point": False, "pre_quant_scale": True},
        config_groups=False,  # ModelOpt 0.47 writes none for W4A16_AWQ
    ),
    # llm-compressor's W4A16 (symmetric, group 128), as compressed-tensors serializes it
    compressed_tensors=CompressedTensorsScheme(
        "pack-quantized",
        weights={
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "group_size": 128,
            "strategy": "group",
            "dynamic": False,
        },
        codec=pack_quantized_codec(4, unpack_int4_rows, pack_int4_rows),
        scale_divisor=7.5,  # (7 - -8) / 2
    ),
)
