"""compressed-tensors' own tensors for the built-in formats (each scheme's :class:`LeafCodec`).

What compressed-tensors stores, read from its source (0.20.1 and 0.17,
``compressors/pack_quantized``, ``compressors/nvfp4``, ``quantization/lifecycle``):

* ``pack-quantized`` (integer weight-only, 1..8 bits; of the built-ins INT4 group
  and INT8 channel): ``weight_packed`` int32 ``[out, ceil(in * bits / 32)]``, the
  signed codes offset by ``2 ** (bits - 1)`` and packed densely along the input
  dimension, element ``i`` at bit ``i * bits`` (``pack_to_int32``);
  ``weight_scale`` ``[out, in / group]`` (channel: ``[out, 1]``);
  ``weight_shape`` int64 ``[2]``; a ``weight_zero_point`` only when asymmetric.
* ``nvfp4-pack-quantized``: ``weight_packed`` uint8 ``[out, in / 2]`` (the even
  column in the low nibble, as ModelOpt), ``weight_scale`` float8_e4m3fn
  ``[out, in / 16]``, ``weight_global_scale`` fp32 ``[1]`` and
  ``input_global_scale`` fp32 ``[1]``. A global scale stands for the *reciprocal* of
  ModelOpt's second level: ``448 * 6 / amax`` (``generate_gparam``), applied as
  ``scale / global_scale``. The NVFP4 kernels compute with it as it is under the
  recipe option ``scales=compressed-tensors``; a ModelOpt-convention scale is stored
  as its float32 reciprocal by the layout (:class:`~exportlm.quant.formats.CheckpointLayout`),
  one last bit off for some values.

Everything here is a pure re-layout: the codes, the group scales and the float8
block scales are the format's own, byte for byte.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from exportlm.quant.formats._parts import LeafCodec, LeafTensors, StoredLeaf, StoredScale

__all__ = [
    "decode_channel_scales",
    "encode_channel_scales",
    "nvfp4_codec",
    "pack_int32",
    "pack_quantized_codec",
    "unpack_int32",
]

#: Codes and the format's native code tensor, both ways (INT4: pairs of rows in a byte).
CodesFn = Callable[[torch.Tensor], torch.Tensor]


def _words(raw: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., 4 * n]`` as little-endian int32 words ``[..., n]``."""
    if sys.byteorder == "big":
        raw = raw.reshape(*raw.shape[:-1], -1, 4).flip(-1).reshape(raw.shape)
    return raw.contiguous().view(torch.int32)


def _bytes(words: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_words`."""
    raw = words.contiguous().view(torch.uint8)
    if sys.byteorder == "big":
        raw = raw.reshape(*raw.shape[:-1], -1, 4).flip(-1).reshape(raw.shape)
    return raw


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed ``bits``-bit ``codes`` (int8, last dim = input) packed as compressed-tensors does.

    ``bits`` is 4 or 8 (the widths whose codes never straddle a byte); the
    result has ``ceil(cols * bits / 32)`` int32 words per row, zero-padded.
    """
    if bits not in (4, 8):
        raise ValueError(f"pack_int32 packs 4- or 8-bit codes, got {bits} bits")
    raw = (codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    if bits == 4:
        if raw.shape[-1] % 2:
            raw = torch.nn.functional.pad(raw, (0, 1))
        raw = raw[..., 0::2] | (raw[..., 1::2] << 4)
    pad = -raw.shape[-1] % 4
    if pad:
        raw = torch.nn.functional.pad(raw, (0, pad))
    return _words(raw)


def unpack_int32(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The signed int8 codes ``[..., cols]`` packed in ``words`` (inverse of :func:`pack_int32`)."""
    if bits not in (4, 8):
        raise ValueError(f"unpack_int32 unpacks 4- or 8-bit codes, got {bits} bits")
    raw = _bytes(words)
    if bits == 4:
        raw = torch.stack((raw & 0x0F, raw >> 4), dim=-1).reshape(*raw.shape[:-1], -1)
    if raw.shape[-1] < cols:
        raise ValueError(f"{words.shape[-1]} packed words hold fewer than {cols} codes")
    return (raw[..., :cols].to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def pack_quantized_codec(bits: int, to_codes: CodesFn, from_codes: CodesFn) -> LeafCodec:
    """``pack-quantized``: ``weight_packed`` int32, ``weight_scale`` ``[out, groups]``, ``weight_shape``.

    ``to_codes`` turns the format's ``weight`` into signed int8 codes ``[out, in]``,
    ``from_codes`` back. A symmetric format: no zero point is written.
    """

    def encode(leaves: LeafTensors) -> dict[str, torch.Tensor]:
        codes = to_codes(leaves["weight"])
        scale = leaves["weight_scale"]
        return {
            "weight_packed": pack_int32(codes, bits),
            "weight_scale": scale.reshape(*codes.shape[:-1], -1),
            "weight_shape": torch.tensor(codes.shape, dtype=torch.int64),
        }

    def decode(leaves: LeafTensors) -> dict[str, torch.Tensor]:
        shape = [int(d) for d in leaves["weight_shape"].tolist()]
        codes = unpack_int32(leaves["weight_packed"], bits, shape[-1]).reshape(shape)
        return {"weight": from_codes(codes), "weight_scale": leaves["weight_scale"]}

    return LeafCodec(
        weights=(
            StoredLeaf("weight_packed", torch.int32, "codes"),
            StoredLeaf("weight_scale", torch.float32),
            StoredLeaf("weight_shape", torch.int64, "shape"),
        ),
        encode=encode,
        decode=decode,
        activations={"pre_quant_scale": None},
        refusal=(
            "compressed-tensors has no pre_quant_scale tensor (its AWQ smooths the scale into "
            "the preceding layer before quantizing), and this scale could not be folded into "
            "the norm that feeds the layer; quantize with the compressed-tensors convention "
            "('int4_awq:scales=compressed-tensors', which export -o format=compressed-tensors "
            "chooses: every scale folds into the norm or linear before it, or the layer is "
            "round-to-nearest), export with format='modelopt', or leave the layer unquantized "
            "(quantize(..., exclude=[...]))"
        ),
    )


def _positive_zeros(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 code 8 (-0.0) as code 0 (+0.0) in both nibbles, as compressed-tensors packs it.

    The same value either way; ModelOpt keeps the sign of a value that rounds to zero.
    """
    low, high = packed & 0x0F, packed >> 4
    low = torch.where(low == 8, torch.zeros_like(low), low)
    high = torch.where(high == 8, torch.zeros_like(high), high)
    return (high << 4) | low


def nvfp4_codec() -> LeafCodec:
    """``nvfp4-pack-quantized``: the codes (zeros unsigned) and block scales, and the second
    levels as global scales (``global_scale=True``: the layout hands them over as such)."""

    def encode(leaves: LeafTensors) -> dict[str, torch.Tensor]:
        return {
            "weight_packed": _positive_zeros(leaves["weight"]),
            "weight_scale": leaves["weight_scale"],
            "weight_global_scale": leaves["weight_scale_2"].to(torch.float32).reshape(1),
        }

    def decode(leaves: LeafTensors) -> dict[str, torch.Tensor]:
        return {
            "weight": leaves["weight_packed"],
            "weight_scale": leaves["weight_scale"],
            "weight_scale_2": leaves["weight_global_scale"].to(torch.float32).reshape(()),
        }

    return LeafCodec(
        weights=(
            StoredLeaf("weight_packed", torch.uint8, "codes"),
            StoredLeaf("weight_scale", torch.float8_e4m3fn),
            StoredLeaf("weight_global_scale", torch.float32),
        ),
        encode=encode,
        decode=decode,
        activations={"input_scale": StoredScale("input_global_scale", reciprocal=True)},
        global_scale=True,
    )


def encode_channel_scales(leaves: LeafTensors) -> dict[str, torch.Tensor]:
    """Per-row ``weight_scale [out]`` as compressed-tensors' channel scales ``[out, 1]``."""
    return {"weight": leaves["weight"], "weight_scale": leaves["weight_scale"].reshape(-1, 1)}


def decode_channel_scales(leaves: LeafTensors) -> dict[str, torch.Tensor]:
    """compressed-tensors' channel scales ``[out, 1]`` back as ``weight_scale [out]``."""
    return {"weight": leaves["weight"], "weight_scale": leaves["weight_scale"].reshape(-1)}
