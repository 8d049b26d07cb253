"""Fake quantization: quantizers, quantized module wrappers and ``quantize``.

``quantize(model, "fp8")`` converts a model's linear layers (and fused MoE
experts) into wrappers that fake-quantize weights and activations, calibrated
by max calibration. The exporters of :mod:`exportlm.modules` write the real
quantized tensors; for every format the fake-quantized weight equals the
dequantized exported weight bit for bit.
"""

from exportlm.quant._formats import (
    FP4_MAX,
    FP8_MAX,
    INT4_MAX,
    INT8_MAX,
    QuantFormat,
    QuantizedTensor,
    dequantize,
    quantize_tensor,
    safe_scale,
)
from exportlm.quant._modules import (
    QuantBMMExperts,
    QuantEmbedding,
    QuantExperts,
    QuantFusedExperts,
    QuantLinear,
    QuantModule,
    QuantMoELinear,
    is_fused_experts,
    is_quantized_module,
)
from exportlm.quant._quantize import (
    iterable_expert_lists,
    quantize,
    unify_expert_input_amax,
    wrap_module,
)
from exportlm.quant._quantizer import TensorQuantizer
from exportlm.quant._recipe import (
    ALGORITHMS,
    DEFAULT_EXCLUDE,
    KV_CACHE_FORMATS,
    Algorithm,
    QuantRecipe,
    recipe_names,
)
from exportlm.quant._synthetic import synthetic_calibration

__all__ = [
    "ALGORITHMS",
    "DEFAULT_EXCLUDE",
    "FP4_MAX",
    "FP8_MAX",
    "INT4_MAX",
    "INT8_MAX",
    "KV_CACHE_FORMATS",
    "Algorithm",
    "QuantBMMExperts",
    "QuantEmbedding",
    "QuantExperts",
    "QuantFormat",
    "QuantFusedExperts",
    "QuantLinear",
    "QuantMoELinear",
    "QuantModule",
    "QuantRecipe",
    "QuantizedTensor",
    "TensorQuantizer",
    "dequantize",
    "is_fused_experts",
    "is_quantized_module",
    "iterable_expert_lists",
    "quantize",
    "quantize_tensor",
    "recipe_names",
    "safe_scale",
    "synthetic_calibration",
    "unify_expert_input_amax",
    "wrap_module",
]
