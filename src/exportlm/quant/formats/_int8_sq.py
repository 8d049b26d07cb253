"""INT8 W8A8 with SmoothQuant: per-channel int8 weights, per-tensor static int8 inputs.

``int8_sq`` is NVIDIA ModelOpt's ``INT8_SMOOTHQUANT_CFG`` (``quant_algo:
W8A8_SQ_PER_CHANNEL``, read by TensorRT-LLM): ``weight`` int8 ``[out, in]`` with
``weight_scale`` fp32 ``[out] = row_amax / 127`` of the smoothed weight,
``input_scale`` fp32 0-d ``= activation amax / 127`` (of the smoothed input) and
``pre_quant_scale`` fp32 ``[in]``, the SmoothQuant scale the input is multiplied by
(the weight was divided by it). Smoothing uses ModelOpt's default ``alpha = 1.0``
(``SmoothQuantCalibConfig.alpha``); see :mod:`exportlm.quant._smoothquant`.

Two specs: the weight format ``int8_sq`` (its scales derived from each row, as
INT8 weight-only) and the activation format ``int8_tensor`` (one calibrated
per-tensor scale), which the weight format names as its ``activations``. The
recipes ``int8_sq`` and ``w8a8`` (SmoothQuant's alpha, folding) are records of
their own (:mod:`exportlm.quant._recipes_builtin`).

``w8a8`` is llm-compressor's ``W8A8`` scheme behind its ``SmoothQuantModifier``
(``smoothing_strength = 0.5``, its default): per-row int8 weights with
compressed-tensors' scale ``row_amax / 127.5`` (:data:`CT_INT8_DIVISOR`), inputs
quantized per token at run time (the ``int8`` format's per-row kernel on each
token: no input scale is stored), and only the linears fed by a norm smoothed, the
scale folded into that norm (``q/k/v`` <- ``input_layernorm``, ``gate/up`` <-
``post_attention_layernorm``, llm-compressor's default mappings). It is written
in compressed-tensors' ``int-quantized`` layout (``weight`` int8 ``[out, in]``,
``weight_scale`` ``[out, 1]``), which vLLM serves (``compressed_tensors_w8a8_int8``,
on CPUs too); ModelOpt has no such scheme, so ``format="modelopt"`` refuses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from exportlm.quant._tensor import INT8_MAX, QuantizedTensor, safe_scale, scaled_quotient
from exportlm.quant.formats._ct_codecs import decode_channel_scales, encode_channel_scales
from exportlm.quant.formats._int8 import (
    CT_INT8_CHANNEL_ARGS,
    MODELOPT_INT8_ARGS,
    dequantize_int8,
    quantize_int8,
)
from exportlm.quant.formats._parts import (
    CompressedTensorsScheme,
    Leaf,
    LeafCodec,
    ModelOptScheme,
    StoredLeaf,
)
from exportlm.quant.formats._spec import FormatSpec, QuantizeFn

__all__ = [
    "CT_INT8_DIVISOR",
    "INT8_SQ",
    "INT8_TENSOR",
    "LLMC_SMOOTHING_STRENGTH",
    "SMOOTHQUANT_ALPHA",
    "W8A8",
]

#: SmoothQuant's migration strength: ModelOpt 0.47's default
#: (``modelopt.torch.quantization.config.SmoothQuantCalibConfig.alpha = 1.0``).
SMOOTHQUANT_ALPHA = 1.0

#: llm-compressor's ``SmoothQuantModifier.smoothing_strength`` default.
LLMC_SMOOTHING_STRENGTH = 0.5

#: compressed-tensors' ``W8A8`` preset (``quantization/quant_scheme.py`` ``INT8_W8A8``):
#: the per-channel int8 weights, inputs per token at run time.
_CT_TOKENS = {**CT_INT8_CHANNEL_ARGS, "strategy": "token", "dynamic": True}


#: compressed-tensors' symmetric integer scale, ``amax / ((q_max - q_min) / 2)``: for
#: int8 ``amax / 127.5`` (``quantization/utils/helpers.py`` ``calculate_qparams``:
#: ``max_val_pos / (float(bit_range) / 2)``), where ModelOpt divides by 127. Measured:
#: llm-compressor 0.14's unsmoothed ``o_proj`` scales are ours * 127 / 127.5.
CT_INT8_DIVISOR = 127.5


def _rows_kernel(name: str, divisor: float) -> QuantizeFn:
    """A per-row int8 kernel (``row_amax / divisor``), its tensors labelled ``name``."""

    def quantize(
        x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
    ) -> QuantizedTensor:
        if divisor == INT8_MAX:
            q = quantize_int8(x, scale=scale, block_size=None, where=where)
            return dataclasses.replace(q, format=name)
        x32 = x.detach().to(torch.float32)
        rows = safe_scale(x32.abs().amax(dim=-1), divisor, where=where) if scale is None else scale
        codes = scaled_quotient(x32, rows.unsqueeze(-1)).round().clamp(-128, 127).to(torch.int8)
        return QuantizedTensor(name, codes, rows, shape=tuple(x.shape), dtype=x.dtype)

    return quantize


def _rows_spec(
    name: str,
    leaves: tuple[Leaf, ...],
    activations: str,
    divisor: float = INT8_MAX,
    **schemes: Any,
) -> FormatSpec:
    """A per-row int8 weight format (``weight`` int8 ``[out, in]``, ``weight_scale [out]``)."""
    return FormatSpec(
        format=name,
        quantize=_rows_kernel(name, divisor),
        dequantize=dequantize_int8,
        maxbound=INT8_MAX,
        amax_divisor=divisor,
        granularity="row",
        leaves=(
            Leaf("weight", torch.int8, source="data"),
            Leaf("weight_scale", torch.float32, source="scale"),
            *leaves,
        ),
        activations=activations,
        **schemes,
    )


#: compressed-tensors ``int-quantized`` (``IntQuantizationCompressor``): the int8 codes
#: as ``weight``, the channel scales as ``weight_scale [out, 1]``, no zero point
#: (symmetric); no ``pre_quant_scale`` tensor (the scale must fold into the norm).
_INT_QUANTIZED = LeafCodec(
    weights=(
        StoredLeaf("weight", torch.int8, "codes"),
        StoredLeaf("weight_scale", torch.float32),
    ),
    encode=encode_channel_scales,
    decode=decode_channel_scales,
    activations={"pre_quant_scale": None},
    refusal=(
        "compressed-tensors has no pre_quant_scale tensor (llm-compressor's SmoothQuant "
        "folds every scale into the preceding norm), and this linear's scale was not folded; "
        "quantize with recipe 'w8a8' (which smooths only norm-fed linears) or export with "
        "format='modelopt'"
    ),
)


def quantize_int8_tensor(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """Round ``x / scale`` to int8 (clamped to [-128, 127]) with one calibrated scale."""
    if scale is None:
        raise ValueError(f"{where}: per-tensor int8 quantization needs the calibrated scale")
    x32 = x.detach().to(torch.float32)
    codes = (x32 / scale.to(x32.device)).round().clamp(-128, 127).to(torch.int8)
    return QuantizedTensor("int8_tensor", codes, scale, shape=tuple(x.shape), dtype=x.dtype)


def dequantize_int8_tensor(q: QuantizedTensor) -> torch.Tensor:
    """``codes * scale`` in float32."""
    return q.data.to(torch.float32) * q.scale


INT8_SQ = _rows_spec(
    "int8_sq",
    (
        Leaf("input_scale", torch.float32, role="activation"),
        Leaf("pre_quant_scale", torch.float32, role="activation"),
    ),
    "int8_tensor",
    # ModelOpt 0.47 writes no config_groups for W8A8_SQ_PER_CHANNEL (quant_algo, ignore,
    # producer only), as for W8A16.
    modelopt=ModelOptScheme(
        "W8A8_SQ_PER_CHANNEL",
        weights=MODELOPT_INT8_ARGS,
        input_activations=MODELOPT_INT8_ARGS,
        config_groups=False,
    ),
)

INT8_TENSOR = FormatSpec(
    format="int8_tensor",
    quantize=quantize_int8_tensor,
    dequantize=dequantize_int8_tensor,
    maxbound=INT8_MAX,
    amax_divisor=INT8_MAX,
    granularity="tensor",
    leaves=(
        Leaf("weight", torch.int8, source="data"),
        Leaf("weight_scale", torch.float32, source="scale"),
        Leaf("input_scale", torch.float32, role="activation"),
    ),
    calibrated=True,
)

W8A8 = _rows_spec(
    "w8a8",
    (Leaf("pre_quant_scale", torch.float32, role="activation"),),
    "int8",  # per row of the last dimension: per token, at run time
    divisor=CT_INT8_DIVISOR,
    compressed_tensors=CompressedTensorsScheme(
        "int-quantized",
        weights=CT_INT8_CHANNEL_ARGS,
        input_activations=_CT_TOKENS,
        codec=_INT_QUANTIZED,
        scale_divisor=CT_INT8_DIVISOR,
    ),
)
