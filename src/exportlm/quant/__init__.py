"""Fake quantization: quantizers, quantized module wrappers and ``quantize``.

``quantize(model, "fp8")`` converts a model's linear layers (and fused MoE
experts) into wrappers that fake-quantize weights and activations, calibrated
by max calibration. The exporters of :mod:`exportlm.module_exporters` write the real
quantized tensors; for every format the fake-quantized weight equals the
dequantized exported weight bit for bit.

Formats are data (:mod:`exportlm.quant.formats`): one :class:`FormatSpec` per
format in :data:`QUANT_FORMATS`; :func:`register_format` adds one to everything
above. Recipes are records of their own (:class:`Recipe`: weight format, activation
format, calibration algorithm and options) in :data:`RECIPE_REGISTRY`;
:func:`register_recipe` (or the ``exportlm.recipes`` entry-point group) adds one.
"""

from exportlm.quant._awq import awq_margin
from exportlm.quant._awq_search import PORTABLE_MARGIN
from exportlm.quant._expert_modules import QuantBMMExperts, QuantExperts, QuantFusedExperts
from exportlm.quant._experts import experts_base, is_fused_experts
from exportlm.quant._formats import dequantize, quantize_tensor
from exportlm.quant._kv import route_kv_cache_to_attention
from exportlm.quant._modules import (
    QuantEmbedding,
    QuantLinear,
    QuantModule,
    QuantMoELinear,
    is_quantized_module,
)
from exportlm.quant._quantize import (
    check_recipe,
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
    recipe_for_format,
    recipe_names,
    recipe_options,
    recipes_for_format,
    resolve_algorithm,
)
from exportlm.quant._recipe_registry import (
    RECIPE_REGISTRY,
    RECIPES_GROUP,
    ensure_recipes_registered,
    recipes,
    register_recipe,
)
from exportlm.quant._recipes import KVCacheRecipe, Recipe
from exportlm.quant._refusals import check_layout, check_layout_model, check_layout_model_type
from exportlm.quant._synthetic import synthetic_calibration
from exportlm.quant._tensor import (
    FP4_MAX,
    FP8_MAX,
    INT4_MAX,
    INT8_MAX,
    FormatId,
    QuantFormat,
    QuantizedTensor,
    safe_scale,
)
from exportlm.quant.formats import (
    QUANT_FORMATS,
    FormatSpec,
    Leaf,
    get_format,
    register_format,
    scale_leaf_names,
)

__all__ = [
    "ALGORITHMS",
    "DEFAULT_EXCLUDE",
    "FP4_MAX",
    "FP8_MAX",
    "INT4_MAX",
    "INT8_MAX",
    "KV_CACHE_FORMATS",
    "PORTABLE_MARGIN",
    "QUANT_FORMATS",
    "RECIPES_GROUP",
    "RECIPE_REGISTRY",
    "Algorithm",
    "FormatId",
    "FormatSpec",
    "KVCacheRecipe",
    "Leaf",
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
    "Recipe",
    "TensorQuantizer",
    "awq_margin",
    "check_layout",
    "check_layout_model",
    "check_layout_model_type",
    "check_recipe",
    "dequantize",
    "ensure_recipes_registered",
    "experts_base",
    "get_format",
    "is_fused_experts",
    "is_quantized_module",
    "iterable_expert_lists",
    "quantize",
    "quantize_tensor",
    "recipe_for_format",
    "recipe_names",
    "recipe_options",
    "recipes_for_format",
    "recipes",
    "resolve_algorithm",
    "route_kv_cache_to_attention",
    "register_format",
    "register_recipe",
    "safe_scale",
    "scale_leaf_names",
    "synthetic_calibration",
    "unify_expert_input_amax",
    "wrap_module",
]
