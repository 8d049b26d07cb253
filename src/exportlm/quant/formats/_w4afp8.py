"""W4AFP8: INT4 group weights, FP8 inputs quantized per token at run time (``w4afp8``).

compressed-tensors' / llm-compressor's ``W4AFP8`` preset (``quantization/quant_scheme.py``):
weights ``int``, 4 bits, symmetric, ``strategy: group``, ``group_size: 128``; inputs
``float``, 8 bits, symmetric, ``strategy: token``, ``dynamic: true``. The weights are
the :mod:`~exportlm.quant.formats._int4` codes and scales (the same kernels, stored
``pack-quantized`` as W4A16 stores them: ``weight_packed`` int32 ``[out, in / 8]``,
``weight_scale [out, in / group]``, ``weight_shape``); no ``input_scale`` is stored: each
token (a row of the last dimension) is quantized with its own ``amax / 448`` at run time,
the ``fp8_dynamic`` format's kernel (compressed-tensors' dynamic ``token`` FP8).

vLLM runs it with ``CompressedTensorsW4A8Fp8`` on compute capability 9.0 exactly
(Hopper) and group size 128 only. ModelOpt has no INT4 format with dynamic FP8 inputs
(its ``W4A8_AWQ`` quantizes them statically per tensor: recipe ``w4a8_awq``), so the spec
declares no ModelOpt scheme and that layout refuses it, naming both.
"""

from __future__ import annotations

import dataclasses

import torch

from exportlm.quant._tensor import INT4_MAX, QuantFormat, QuantizedTensor
from exportlm.quant.formats._ct_codecs import pack_quantized_codec
from exportlm.quant.formats._int4 import (
    dequantize_int4,
    pack_int4_rows,
    quantize_int4,
    unpack_int4_rows,
)
from exportlm.quant.formats._parts import CompressedTensorsScheme, Leaf
from exportlm.quant.formats._spec import FormatSpec

__all__ = ["VLLM_GROUP_SIZE", "W4AFP8"]

_NAME = "w4afp8"
#: The one group size vLLM 0.32's ``CompressedTensorsW4A8Fp8`` takes (``__init__`` raises
#: "W4A8 kernels require group quantization with group size 128" for any other).
VLLM_GROUP_SIZE = 128
#: compressed-tensors' ``W4AFP8`` preset's weights (as W4A16's) and inputs, as it serializes them.
_CT_WEIGHTS = {
    "num_bits": 4,
    "type": "int",
    "symmetric": True,
    "group_size": 128,
    "strategy": "group",
    "dynamic": False,
}
_CT_INPUTS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "token",
    "dynamic": True,
}


def quantize_w4afp8(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """The codes and group scales of :func:`quantize_int4`, named as this format's."""
    q = quantize_int4(x, scale=scale, block_size=block_size, where=where)
    return dataclasses.replace(q, format=_NAME)


W4AFP8 = FormatSpec(
    format=_NAME,
    quantize=quantize_w4afp8,
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
    block_size=128,
    # inputs per token at run time: fp8_dynamic's per-row kernel on each token
    activations="fp8_dynamic",
    search_format=QuantFormat.INT4,  # the same kernels: AWQ searches as int4_awq does
    compressed_tensors=CompressedTensorsScheme(
        "pack-quantized",
        weights=_CT_WEIGHTS,
        input_activations=_CT_INPUTS,
        codec=pack_quantized_codec(4, unpack_int4_rows, pack_int4_rows),  # int4's
        scale_divisor=7.5,  # int4's: compressed-tensors' (7 - -8) / 2
    ),
    modelopt_instead=(
        "ModelOpt's W4A8 quantizes the inputs statically per tensor: quantize with recipe "
        "'w4a8_awq' for format='modelopt'"
    ),
)
