"""W4A8 AWQ: INT4 weights in groups (AWQ-scaled) run as FP8, FP8 static per-tensor inputs.

NVIDIA ModelOpt's ``W4A8_AWQ_BETA_CFG`` (``quant_algo: W4A8_AWQ``, read by TensorRT-LLM):
the weight quantizer is INT4 per group of 128 followed by FP8 per tensor, the input
quantizer FP8 per tensor after the AWQ ``pre_quant_scale``. Its checkpoint, as ModelOpt
0.47's ``export_hf_checkpoint`` writes it (measured on CPU):

- ``weight`` uint8 ``[out / 2, in]``: the INT4 codes of ``w / weight_scale`` packed as
  :mod:`~exportlm.quant.formats._int4` packs them (pairs of rows, the even row low);
- ``weight_scale`` fp32 ``[out, in / group] = group_amax / 7``;
- ``weight_scale_2`` fp32 0-d ``= amax / 448``: the FP8 second level, one per fused GEMM
  (``q/k/v``, ``gate/up`` share it, as ModelOpt's export unifies it);
- ``input_scale`` fp32 0-d ``= input amax / 448`` (of the input times ``pre_quant_scale``);
- ``pre_quant_scale`` fp32 ``[in]`` where the AWQ scale is not folded into a norm.

The weight a kernel computes with is ``fp8(codes * weight_scale / weight_scale_2) *
weight_scale_2``: the INT4 value rounded once more to FP8 (what the FP8 GEMM consumes),
which is what :func:`dequantize_w4a8` returns and the fake-quantized model uses.

compressed-tensors cannot hold it: its ``W4AFP8`` preset quantizes inputs per token at
run time (no ``input_scale``) and has no second weight scale for the FP8 rounding, so the
layout is refused (``compressed_tensors=None``).
"""

from __future__ import annotations

import torch

from exportlm.quant._tensor import FP8_MAX, INT4_MAX, QuantFormat, QuantizedTensor
from exportlm.quant.formats._int4 import dequantize_int4, quantize_int4
from exportlm.quant.formats._parts import Leaf, ModelOptScheme
from exportlm.quant.formats._spec import FormatSpec

__all__ = ["W4A8", "W4A8_FORMAT"]

#: The format's registry name (the weight format of the ``w4a8_awq`` recipe).
W4A8_FORMAT = "w4a8"


def quantize_w4a8(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """INT4 codes and group scales of ``x`` (as ``int4``), with ``scale`` as ``weight_scale_2``."""
    if scale is None:
        raise ValueError(f"{where}: w4a8 quantization needs the per-tensor FP8 scale")
    q = quantize_int4(x, scale=None, block_size=block_size, where=where)
    return QuantizedTensor(
        W4A8_FORMAT, q.data, q.scale, scale.to(torch.float32), q.block_size, q.shape, q.dtype
    )


def dequantize_w4a8(q: QuantizedTensor) -> torch.Tensor:
    """``fp8(int4 value / scale_2) * scale_2`` in float32 (saturating at 448)."""
    if q.scale_2 is None:
        raise ValueError("a w4a8 QuantizedTensor needs scale_2 (weight_scale_2)")
    s2 = q.scale_2.to(torch.float32).to(q.data.device)
    values = dequantize_int4(q).div_(s2).clamp_(-FP8_MAX, FP8_MAX)
    return values.to(torch.float8_e4m3fn).to(torch.float32).mul_(s2)


_INT4_ARGS = {"dynamic": False, "num_bits": 4, "type": "int"}
_FP8_ARGS = {"dynamic": False, "num_bits": 8, "type": "float"}

W4A8 = FormatSpec(
    format=W4A8_FORMAT,
    quantize=quantize_w4a8,
    dequantize=dequantize_w4a8,
    maxbound=INT4_MAX,
    amax_divisor=FP8_MAX,  # the per-tensor scale is the FP8 second level, amax / 448
    granularity="block",
    leaves=(
        Leaf("weight", torch.uint8, source="data"),
        Leaf("weight_scale", torch.float32, source="scale"),
        Leaf("weight_scale_2", torch.float32, source="scale_2"),
        Leaf("input_scale", torch.float32, role="activation"),
        Leaf("pre_quant_scale", torch.float32, role="activation"),
    ),
    calibrated=True,
    packing=2,
    packed_dim=-2,
    block_size=128,
    activations="fp8",
    # ModelOpt 0.47 writes no config_groups for W4A8_AWQ (quant_algo, group_size,
    # has_zero_point, pre_quant_scale, exclude_modules), as for W4A16_AWQ.
    modelopt=ModelOptScheme(
        "W4A8_AWQ",
        weights=_INT4_ARGS,
        input_activations=_FP8_ARGS,
        layer_fields={"has_zero_point": False, "pre_quant_scale": True},
        config_groups=False,
    ),
    share_fused_weight_amax=True,
    search_format=QuantFormat.INT4,
)
