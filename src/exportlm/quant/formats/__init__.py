"""Quantization formats as data: one :class:`FormatSpec` per format, in :data:`QUANT_FORMATS`.

Every fake-quantization in :mod:`exportlm.quant` is ``dequantize(quantize(x))``
with a spec's kernels, and every exporter writes the leaves the spec declares.
That is what makes the fake-quantized model and the dequantized checkpoint
agree bit for bit. Generic code (the quantizer, ``quantize``, the module
exporters) reads the spec; adding a format is one :func:`register_format` call.

Built-in layouts (NVIDIA ModelOpt's, which vLLM, SGLang and TensorRT-LLM read):

========  ============================  ===========================================
format    ``weight``                    scales
========  ============================  ===========================================
fp8       float8_e4m3fn ``[out, in]``   ``weight_scale`` fp32 0-d ``= amax / 448``
nvfp4     uint8 ``[out, in / 2]``: two  ``weight_scale`` float8_e4m3fn ``[out, in / 16]``
          E2M1 codes per byte, even     ``= block_amax / (6 * weight_scale_2)``;
          column in the low nibble      ``weight_scale_2`` fp32 0-d ``= amax / (6 * 448)``
int4      uint8 ``[out / 2, in]``: two  ``weight_scale`` fp32 ``[out, in / group]``
          int4 per byte, even row in    ``= group_amax / 7``; AWQ ``pre_quant_scale``
          the low nibble
int8      int8 ``[out, in]``            ``weight_scale`` fp32 ``[out] = row_amax / 127``
========  ============================  ===========================================

FP8 and NVFP4 also quantize activations (``input_scale``); FP8 is the format of
the KV cache (``k_scale`` / ``v_scale``, recipe ``fp8_kv``).

The checkpoint layouts are data as well (:data:`CHECKPOINT_LAYOUTS`, one
:class:`CheckpointLayout` per ``format=`` value: the shape of per-tensor scales,
the formats it holds), and :data:`MIXED_PRECISION` is defined here once. A
format's scheme for a layout may carry a :class:`LeafCodec`: the layout's own
names, dtypes and shapes for the format's tensors (compressed-tensors stores INT4
and INT8 as ``pack-quantized`` int32 ``weight_packed``, NVFP4 with reciprocal
``weight_global_scale`` / ``input_global_scale``).
"""

from exportlm.quant.formats._fp8 import FP8
from exportlm.quant.formats._int4 import INT4
from exportlm.quant.formats._int8 import INT8
from exportlm.quant.formats._layouts import (
    CHECKPOINT_LAYOUTS,
    DEFAULT_LAYOUT,
    HALF_FLOATS,
    MIXED_PRECISION,
    CheckpointLayout,
    ExportFormat,
    checkpoint_layout,
)
from exportlm.quant.formats._nvfp4 import E2M1_VALUES, NVFP4
from exportlm.quant.formats._parts import (
    CompressedTensorsScheme,
    FineGrainedFP8Scheme,
    GptOssMxfp4Scheme,
    KVCacheScheme,
    Leaf,
    LeafCodec,
    LeafRole,
    ModelOptScheme,
    StoredLeaf,
    StoredScale,
    WeightRecipe,
)
from exportlm.quant.formats._registry import (
    BUILTIN_FORMATS,
    QUANT_FORMATS,
    activation_leaf_names,
    format_for_kv_cache_algo,
    format_for_quant_algo,
    formats,
    get_format,
    register_format,
    scale_leaf_names,
)
from exportlm.quant.formats._spec import DequantizeFn, FormatSpec, Granularity, QuantizeFn

__all__ = [
    "BUILTIN_FORMATS",
    "CHECKPOINT_LAYOUTS",
    "DEFAULT_LAYOUT",
    "E2M1_VALUES",
    "FP8",
    "HALF_FLOATS",
    "INT4",
    "INT8",
    "MIXED_PRECISION",
    "NVFP4",
    "QUANT_FORMATS",
    "CheckpointLayout",
    "CompressedTensorsScheme",
    "DequantizeFn",
    "ExportFormat",
    "FineGrainedFP8Scheme",
    "GptOssMxfp4Scheme",
    "FormatSpec",
    "Granularity",
    "KVCacheScheme",
    "Leaf",
    "LeafCodec",
    "LeafRole",
    "ModelOptScheme",
    "QuantizeFn",
    "StoredLeaf",
    "StoredScale",
    "WeightRecipe",
    "activation_leaf_names",
    "checkpoint_layout",
    "format_for_kv_cache_algo",
    "format_for_quant_algo",
    "formats",
    "get_format",
    "register_format",
    "scale_leaf_names",
]
