"""INT8 weight-only (W8A16): ``weight`` int8 ``[out, in]``, ``weight_scale`` fp32 ``[out]``.

Per-row symmetric scales ``row_amax / 127``; activations stay float.

compressed-tensors stores weight-only INT8 as ``pack-quantized`` too (its format
inference picks ``int-quantized`` only when activations are quantized): the codes
offset by 128, four per int32 ``weight_packed`` ``[out, in / 4]``, ``strategy:
channel`` with ``weight_scale`` ``[out, 1]``, ``weight_shape``.
"""

from __future__ import annotations

import torch

from exportlm.quant._tensor import (
    INT8_MAX,
    QuantFormat,
    QuantizedTensor,
    safe_scale,
    scaled_quotient,
)
from exportlm.quant.formats._ct_codecs import pack_quantized_codec
from exportlm.quant.formats._parts import (
    CompressedTensorsScheme,
    Leaf,
    ModelOptScheme,
)
from exportlm.quant.formats._spec import FormatSpec

__all__ = ["CT_INT8_CHANNEL_ARGS", "INT8", "MODELOPT_INT8_ARGS"]

#: ModelOpt's fields of an int8 quantizer (weights, and W8A8's inputs).
MODELOPT_INT8_ARGS = {"dynamic": False, "num_bits": 8, "type": "int"}
#: compressed-tensors' per-channel symmetric int8 weights (its ``W8A16`` and ``W8A8``
#: presets' weights with ``strategy: channel``).
CT_INT8_CHANNEL_ARGS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "group_size": None,
    "strategy": "channel",
    "dynamic": False,
}


def quantize_int8(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """Round ``x / (row_amax / 127)`` to int8 (clamped to [-128, 127]); ``scale``: the row
    scales ``[out]`` to use instead (compressed-tensors' convention, :func:`scaled_quotient`)."""
    x32 = x.detach().to(torch.float32)
    row_scale = (
        safe_scale(x32.abs().amax(dim=-1), INT8_MAX, where=where) if scale is None else scale
    )
    codes = scaled_quotient(x32, row_scale.unsqueeze(-1)).round().clamp(-128, 127).to(torch.int8)
    return QuantizedTensor(QuantFormat.INT8, codes, row_scale, shape=tuple(x.shape), dtype=x.dtype)


def dequantize_int8(q: QuantizedTensor) -> torch.Tensor:
    """``codes * row scale`` in float32."""
    return q.data.to(torch.float32) * q.scale.unsqueeze(-1)


def _same(codes: torch.Tensor) -> torch.Tensor:
    return codes  # INT8's own codes are the signed int8 codes compressed-tensors packs


INT8 = FormatSpec(
    format=QuantFormat.INT8,
    quantize=quantize_int8,
    dequantize=dequantize_int8,
    maxbound=INT8_MAX,
    amax_divisor=INT8_MAX,
    granularity="row",
    leaves=(
        Leaf("weight", torch.int8, source="data"),
        Leaf("weight_scale", torch.float32, source="scale"),
    ),
    # ModelOpt 0.47 writes no config_groups for W8A16 (only quant_algo, ignore, producer)
    modelopt=ModelOptScheme("W8A16", weights=MODELOPT_INT8_ARGS, config_groups=False),
    compressed_tensors=CompressedTensorsScheme(
        "pack-quantized",
        weights=CT_INT8_CHANNEL_ARGS,
        codec=pack_quantized_codec(8, _same, _same),
        scale_divisor=127.5,  # (127 - -128) / 2
    ),
)
