"""FP8 per-channel weights, per-token dynamic FP8 inputs (``fp8_dynamic``).

``weight`` float8_e4m3fn ``[out, in]`` with one scale per output row,
``weight_scale = row_amax / 448`` (a zero row gets scale 1.0); no calibration:
the inputs are quantized per token at run time, each token (a row of the last
dimension) with its own ``amax / 448`` (this format's kernel applied to the
activation), so no ``input_scale`` is stored.

It is NVIDIA ModelOpt's ``FP8_PER_CHANNEL_PER_TOKEN`` (``weight_scale`` ``[out]``,
as vLLM's ``ModelOptFp8PcPtLinearMethod`` reads it) and compressed-tensors' /
llm-compressor's ``FP8_DYNAMIC`` preset (``float-quantized``, weights ``strategy:
channel``, inputs ``strategy: token, dynamic: true``, ``weight_scale`` ``[out, 1]``).
"""

from __future__ import annotations

import torch

from exportlm.quant._tensor import FP8_MAX, QuantizedTensor, safe_scale, scaled_quotient
from exportlm.quant.formats._ct_codecs import decode_channel_scales, encode_channel_scales
from exportlm.quant.formats._parts import (
    CompressedTensorsScheme,
    Leaf,
    LeafCodec,
    ModelOptScheme,
    StoredLeaf,
)
from exportlm.quant.formats._spec import FormatSpec

__all__ = ["FP8_DYNAMIC"]

_NAME = "fp8_dynamic"

#: ModelOpt 0.47's group of a ``FP8_PER_CHANNEL_PER_TOKEN`` layer in a mixed-precision
#: ``config.json`` (``export/convert_hf_config.py`` ``_quant_algo_to_group_config``): it
#: writes the inputs ``dynamic: false`` although they are quantized per token at run
#: time; a single-format checkpoint has no ``config_groups`` (only ``quant_algo``).
_MODELOPT_WEIGHTS = {"dynamic": False, "num_bits": 8, "type": "float", "strategy": "channel"}
_MODELOPT_INPUTS = {"dynamic": False, "num_bits": 8, "type": "float"}
#: compressed-tensors' ``FP8_DYNAMIC`` preset (``quantization/quant_scheme.py``).
_CT_WEIGHTS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "channel",
    "dynamic": False,
}
_CT_INPUTS = {**_CT_WEIGHTS, "strategy": "token", "dynamic": True}


def quantize_fp8_rows(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """``x / (row_amax / 448)`` cast to float8_e4m3fn, per row of the last dimension.

    Every scale comes from ``x`` (a weight's output rows, an activation's tokens), unless
    ``scale`` gives the row scales ``[out]`` (compressed-tensors' convention: the quotient
    in their dtype, :func:`~exportlm.quant._tensor.scaled_quotient`); ``block_size`` is unused.
    """
    x32 = x.detach().to(torch.float32)
    rows = safe_scale(x32.abs().amax(dim=-1), FP8_MAX, where=where) if scale is None else scale
    scaled = scaled_quotient(x32, rows.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    codes = scaled.to(torch.float8_e4m3fn)
    return QuantizedTensor(_NAME, codes, rows, shape=tuple(x.shape), dtype=x.dtype)


def dequantize_fp8_rows(q: QuantizedTensor) -> torch.Tensor:
    """``codes * row scale`` in float32."""
    return q.data.to(torch.float32) * q.scale.unsqueeze(-1)


#: compressed-tensors ``float-quantized`` with channel scales: ``weight_scale [out, 1]``.
_CHANNEL_SCALES = LeafCodec(
    weights=(
        StoredLeaf("weight", torch.float8_e4m3fn, "codes"),
        StoredLeaf("weight_scale", torch.float32),
    ),
    encode=encode_channel_scales,
    decode=decode_channel_scales,
)

FP8_DYNAMIC = FormatSpec(
    format=_NAME,
    quantize=quantize_fp8_rows,
    dequantize=dequantize_fp8_rows,
    maxbound=FP8_MAX,
    amax_divisor=FP8_MAX,
    granularity="row",
    leaves=(
        Leaf("weight", torch.float8_e4m3fn, source="data"),
        Leaf("weight_scale", torch.float32, source="scale"),
    ),
    # inputs in this very format: its per-row kernel on each token, at run time
    activations=_NAME,
    modelopt=ModelOptScheme(
        "FP8_PER_CHANNEL_PER_TOKEN",
        weights=_MODELOPT_WEIGHTS,
        input_activations=_MODELOPT_INPUTS,
        config_groups=False,
    ),
    compressed_tensors=CompressedTensorsScheme(
        "float-quantized",
        weights=_CT_WEIGHTS,
        input_activations=_CT_INPUTS,
        codec=_CHANNEL_SCALES,
        scale_divisor=FP8_MAX,  # (448 - -448) / 2
    ),
)
