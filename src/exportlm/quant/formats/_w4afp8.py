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
from typing import cast

import torch

from exportlm.quant._tensor import QuantFormat, QuantizedTensor
from exportlm.quant.formats._int4 import INT4, quantize_int4
from exportlm.quant.formats._parts import CompressedTensorsScheme

__all__ = ["VLLM_GROUP_SIZE", "W4AFP8"]

_NAME = "w4afp8"
#: The one group size vLLM 0.32's ``CompressedTensorsW4A8Fp8`` takes (``__init__`` raises
#: "W4A8 kernels require group quantization with group size 128" for any other).
VLLM_GROUP_SIZE = 128
#: compressed-tensors' ``W4AFP8`` preset's inputs (its weights are W4A16's: ``INT4``'s), as it
#: serializes them.
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


W4AFP8 = dataclasses.replace(
    INT4,  # the same kernels, leaves, packing, group size, codec and scale divisor
    format=_NAME,
    quantize=quantize_w4afp8,
    # inputs per token at run time: fp8_dynamic's per-row kernel on each token
    activations="fp8_dynamic",
    search_format=QuantFormat.INT4,  # the same kernels: AWQ searches as int4_awq does
    modelopt=None,
    compressed_tensors=dataclasses.replace(
        cast(CompressedTensorsScheme, INT4.compressed_tensors), input_activations=_CT_INPUTS
    ),
    modelopt_instead=(
        "ModelOpt's W4A8 quantizes the inputs statically per tensor: quantize with recipe "
        "'w4a8_awq' for format='modelopt'"
    ),
)
