"""OCP Microscaling (MX) formats: ``mxfp4`` (E2M1) and ``mxfp8`` (E4M3) in blocks of 32.

Each block of 32 values along the input features shares one power-of-two scale,
stored as its biased exponent (E8M0: ``uint8``, ``scale = 2 ** (code - 127)``):
``scale = 2 ** (round_pow2(block_amax) - emax)`` with ``emax`` the element format's
largest exponent (E2M1: 2, E4M3: 8) and ``round_pow2(a)`` the exponent of ``a``
rounded up to the next power of two when its mantissa is at least 1.75 (``a = m * 2**e``,
``m`` in [1, 2): ``e + 1`` if ``m >= 1.75`` else ``e``), the exponent clamped to
``[-127, 127]`` (a zero block: ``-127``); an element is ``x / scale`` rounded to nearest
even and saturated to the element's largest value (E2M1: 6, E4M3: 448). That is
compressed-tensors' rule (``generate_mx_scales``, what llm-compressor writes); for E4M3
it equals ModelOpt's ``ceil(log2(block_amax / 448))`` but at a mantissa of exactly
1.75. The OCP spec's example conversion (v1.0, section 6.3) takes ``floor(log2(amax))``
instead, which saturates a block's largest values to the element maximum whenever the
mantissa is above the maximum's (E4M3: 1.75, E2M1: 1.5): on SmolLM2-135M's weights the
MXFP8 weight error is 0.00094 that way against 0.00071 this way (docs/quality.md).

* ``mxfp4``: ``weight`` uint8 ``[out, in / 2]`` (two E2M1 codes per byte, the even
  column in the low nibble), ``weight_scale`` uint8 ``[out, in / 32]``. Weight-only
  (gpt-oss's experts, compressed-tensors' ``MXFP4A16``). ModelOpt's export writes
  ``quant_algo: "mxfp4"`` for it; compressed-tensors ``mxfp4-pack-quantized``
  (``weight_packed``, a value rounded to zero packed unsigned). gpt-oss's own layout
  (``format="gpt-oss-mxfp4"``) stores the same bytes for a GptOss experts stack:
  ``<p>_blocks`` ``[E, out, in / 32, 16]`` and ``<p>_scales`` ``[E, out, in / 32]``.
* ``mxfp8``: ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` uint8
  ``[out, in / 32]``; the inputs quantized at run time with the same kernel per
  block of 32 of each token (no ``input_scale``). ModelOpt's ``MXFP8``
  (vLLM ``modelopt_mxfp8``) and compressed-tensors' ``MXFP8`` (``mxfp8-quantized``).
"""

from __future__ import annotations

import torch

from exportlm.quant._tensor import FP4_MAX, FP8_MAX, QuantizedTensor, split_blocks
from exportlm.quant.formats._ct_codecs import _positive_zeros
from exportlm.quant.formats._nvfp4 import E2M1_VALUES, _e2m1_codes
from exportlm.quant.formats._parts import (
    CompressedTensorsScheme,
    GptOssMxfp4Scheme,
    Leaf,
    LeafCodec,
    LeafTensors,
    ModelOptScheme,
    StoredLeaf,
)
from exportlm.quant.formats._spec import FormatSpec

__all__ = ["E8M0_BIAS", "MX_BLOCK", "MXFP4", "MXFP8", "e8m0_exponents"]

#: The bias of an E8M0 scale code: ``scale = 2 ** (code - 127)``.
E8M0_BIAS = 127
#: The block size of every MX format (the OCP spec's ``k``).
MX_BLOCK = 32
#: ``emax_elem``: the exponent of the element format's largest normal value.
_EMAX = {"mxfp4": 2, "mxfp8": 8}


#: A block amax whose mantissa (in [1, 2)) is at least this rounds up to the next power
#: of two: compressed-tensors' ``round_to_power_2`` with E2M1's one mantissa bit.
_ROUND_UP_MANTISSA = 1.75


def e8m0_exponents(block_amax: torch.Tensor, emax: int) -> torch.Tensor:
    """The unbiased shared exponents ``round_pow2(amax) - emax``, clamped to [-127, 127].

    ``round_pow2``: the exponent of ``amax``, plus one when its mantissa is at least 1.75
    (the module docstring). Read off the float's own exponent and mantissa (``frexp``),
    exact for every value (``torch.log2`` rounds ``1 - 2**-24`` to 0). A zero block: -127.
    """
    mantissa, exponent = torch.frexp(block_amax.to(torch.float32))  # amax = m * 2**e, m in [0.5, 1)
    up = (2 * mantissa >= _ROUND_UP_MANTISSA).to(torch.int32)
    shared = exponent.to(torch.int32) - 1 + up - emax
    shared = torch.where(mantissa == 0, torch.full_like(shared, -E8M0_BIAS), shared)
    return shared.clamp(-E8M0_BIAS, E8M0_BIAS)


def _shared_scales(
    x: torch.Tensor, name: str, block_size: int | None, where: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(blocks, scales as float32, E8M0 codes)`` of ``x`` in blocks of ``block_size``."""
    if block_size != MX_BLOCK:
        raise ValueError(f"{where}: {name} has blocks of {MX_BLOCK}, got block_size={block_size}")
    blocks = split_blocks(x, MX_BLOCK, name, where)
    if not bool(torch.isfinite(blocks).all()):
        from exportlm.errors import QuantizationError

        raise QuantizationError(
            f"{where}: {name} got NaN or inf values; fix the model or exclude this module"
        )
    shared = e8m0_exponents(blocks.abs().amax(dim=-1), _EMAX[name])
    scales = torch.ldexp(torch.ones_like(shared, dtype=torch.float32), shared)
    return blocks, scales, (shared + E8M0_BIAS).to(torch.uint8)


def quantize_mxfp4(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """E2M1 codes (two per byte, even column low) with E8M0 block scales; ``scale`` unused."""
    blocks, scales, codes8 = _shared_scales(x, "mxfp4", block_size, where)
    codes = _e2m1_codes((blocks / scales.unsqueeze(-1)).reshape(x.shape))
    packed = (codes[..., 1::2] << 4) | codes[..., 0::2]
    return QuantizedTensor("mxfp4", packed, codes8, None, MX_BLOCK, tuple(x.shape), x.dtype)


def quantize_mxfp8(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """E4M3 codes with E8M0 block scales, saturated at 448; ``scale`` unused."""
    blocks, scales, codes8 = _shared_scales(x, "mxfp8", block_size, where)
    scaled = (blocks / scales.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).reshape(x.shape)
    codes = scaled.to(torch.float8_e4m3fn)
    return QuantizedTensor("mxfp8", codes, codes8, None, MX_BLOCK, tuple(x.shape), x.dtype)


def _block_scales(q: QuantizedTensor) -> torch.Tensor:
    """The float32 scales ``2 ** (code - 127)`` of ``q``'s E8M0 codes, one per block."""
    shared = q.scale.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(torch.ones_like(shared, dtype=torch.float32), shared)


def _scaled(q: QuantizedTensor, values: torch.Tensor) -> torch.Tensor:
    block = q.block_size or MX_BLOCK
    blocks = values.reshape(*q.shape[:-1], -1, block) * _block_scales(q).unsqueeze(-1)
    return blocks.reshape(q.shape)


def dequantize_mxfp4(q: QuantizedTensor) -> torch.Tensor:
    """E2M1 values times their block's ``2 ** (code - 127)``, float32."""
    codes = torch.stack((q.data & 0x0F, q.data >> 4), dim=-1).reshape(q.shape)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]
    return _scaled(q, values)


def dequantize_mxfp8(q: QuantizedTensor) -> torch.Tensor:
    """E4M3 values times their block's ``2 ** (code - 127)``, float32."""
    return _scaled(q, q.data.to(torch.float32))


def _ct_mxfp4_encode(leaves: LeafTensors) -> dict[str, torch.Tensor]:
    return {
        "weight_packed": _positive_zeros(leaves["weight"]),
        "weight_scale": leaves["weight_scale"],
    }


def _ct_mxfp4_decode(leaves: LeafTensors) -> dict[str, torch.Tensor]:
    return {"weight": leaves["weight_packed"], "weight_scale": leaves["weight_scale"]}


#: compressed-tensors ``mxfp4-pack-quantized``: ``weight_packed`` uint8, E8M0 ``weight_scale``.
_CT_MXFP4_CODEC = LeafCodec(
    weights=(
        StoredLeaf("weight_packed", torch.uint8, "codes"),
        StoredLeaf("weight_scale", torch.uint8),
    ),
    encode=_ct_mxfp4_encode,
    decode=_ct_mxfp4_decode,
)

#: gpt-oss's bytes per block of 32 (16 bytes of two E2M1 codes each).
_BLOCK_BYTES = MX_BLOCK // 2


def _gpt_oss_encode(leaves: LeafTensors) -> dict[str, torch.Tensor]:
    """One expert's ``weight [out, in / 2]`` as ``blocks [out, in / 32, 16]`` (the same bytes:
    transformers' ``_convert_moe_packed_tensors`` reads the low nibble as the even column)."""
    codes = leaves["weight"]
    return {
        "blocks": codes.reshape(*codes.shape[:-1], -1, _BLOCK_BYTES),
        "scales": leaves["weight_scale"],
    }


def _gpt_oss_decode(leaves: LeafTensors) -> dict[str, torch.Tensor]:
    blocks = leaves["blocks"]
    return {"weight": blocks.flatten(-2), "weight_scale": leaves["scales"]}


#: gpt-oss's ``quant_method: "mxfp4"``: ``<p>_blocks`` / ``<p>_scales`` of a GptOss experts
#: stack (the writer stacks one expert's leaves per row of ``E``; the names take the stem).
_GPT_OSS = GptOssMxfp4Scheme(
    LeafCodec(
        weights=(StoredLeaf("blocks", torch.uint8, "codes"), StoredLeaf("scales", torch.uint8)),
        encode=_gpt_oss_encode,
        decode=_gpt_oss_decode,
    )
)

#: compressed-tensors' ``MXFP4A16`` / ``MXFP8`` presets as they serialize (``quant_scheme.py``).
_CT_MX_ARGS = {
    "type": "float",
    "symmetric": True,
    "group_size": MX_BLOCK,
    "strategy": "group",
    "dynamic": False,
    "scale_dtype": "torch.uint8",
    "zp_dtype": "torch.uint8",
}
_CT_MXFP8_INPUTS = {**_CT_MX_ARGS, "num_bits": 8, "dynamic": True}

MXFP4 = FormatSpec(
    format="mxfp4",
    quantize=quantize_mxfp4,
    dequantize=dequantize_mxfp4,
    maxbound=FP4_MAX,
    amax_divisor=FP4_MAX,
    granularity="block",
    leaves=(
        Leaf("weight", torch.uint8, source="data"),
        Leaf("weight_scale", torch.uint8, source="scale"),
    ),
    packing=2,
    packed_dim=-1,
    block_size=MX_BLOCK,
    # ModelOpt 0.47's export names the format in lower case and writes no group_size
    # (``process_layer_quant_config`` has no branch for it) and no config_groups.
    modelopt=ModelOptScheme(
        "mxfp4", weights={"dynamic": False, "num_bits": 4, "type": "float"}, config_groups=False
    ),
    compressed_tensors=CompressedTensorsScheme(
        "mxfp4-pack-quantized", weights={**_CT_MX_ARGS, "num_bits": 4}, codec=_CT_MXFP4_CODEC
    ),
    gpt_oss_mxfp4=_GPT_OSS,
)

MXFP8 = FormatSpec(
    format="mxfp8",
    quantize=quantize_mxfp8,
    dequantize=dequantize_mxfp8,
    maxbound=FP8_MAX,
    amax_divisor=FP8_MAX,
    granularity="block",
    leaves=(
        Leaf("weight", torch.float8_e4m3fn, source="data"),
        Leaf("weight_scale", torch.uint8, source="scale"),
    ),
    block_size=MX_BLOCK,
    activations="mxfp8",  # this kernel on each token's blocks of 32, at run time
    # ModelOpt 0.47 (``_quant_algo_to_group_config``): inputs written ``dynamic: false``
    modelopt=ModelOptScheme(
        "MXFP8",
        weights={"dynamic": False, "num_bits": 8, "type": "float"},
        input_activations={"dynamic": False, "num_bits": 8, "type": "float"},
        config_groups=False,  # a single-format MXFP8 checkpoint has none
    ),
    compressed_tensors=CompressedTensorsScheme(
        "mxfp8-quantized",
        weights={**_CT_MX_ARGS, "num_bits": 8},
        input_activations=_CT_MXFP8_INPUTS,
    ),
)
