"""exportlm's own recipes, as records (registered in code, like every built-in).

``fp8`` matches ModelOpt's ``FP8_DEFAULT_CFG`` (weights and inputs per-tensor E4M3);
``fp8_dynamic`` per-row FP8 weights, inputs per token at run time; ``nvfp4`` ModelOpt's
``NVFP4_DEFAULT_CFG`` (E2M1 blocks of 16, weights and inputs); ``int4_awq`` W4A16 with
groups of 128 (or 32 / 64) and AWQ; ``int8_wo`` W8A16 with per-row scales; ``int8_sq``
ModelOpt's ``INT8_SMOOTHQUANT_CFG`` (alpha 1.0); ``w8a8`` llm-compressor's W8A8 with
its ``SmoothQuantModifier`` (alpha 0.5, folded into the norms); ``fp8_block``
compressed-tensors' ``FP8_BLOCK`` (FP8 weights per 128x128 tile, inputs per group of 128
at run time; ModelOpt's ``FP8_PB_WO`` in its layout). The KV-cache recipe
``fp8_kv`` quantizes the KV cache to FP8 (whose ``kv_cache`` scheme holds its config fields).
``mxfp4`` (weight-only) and ``mxfp8`` (dynamic inputs) are the OCP microscaling formats.
``int4_gptq`` / ``int8_gptq``: ``int4_awq``'s / ``int8_wo``'s formats with GPTQ's codes.
``w4afp8``: compressed-tensors' ``W4AFP8`` (``int4_awq``'s codes, FP8 inputs per token).
"""

from __future__ import annotations

from exportlm.quant._recipes import KVCacheRecipe, Recipe
from exportlm.quant._tensor import QuantFormat
from exportlm.quant.formats._int8_sq import LLMC_SMOOTHING_STRENGTH, SMOOTHQUANT_ALPHA

__all__ = ["BUILTIN_RECIPES"]

BUILTIN_RECIPES: tuple[Recipe | KVCacheRecipe, ...] = (
    Recipe("fp8", QuantFormat.FP8, QuantFormat.FP8),
    Recipe("nvfp4", QuantFormat.NVFP4, QuantFormat.NVFP4),
    Recipe("int4_awq", QuantFormat.INT4, awq=True, group_sizes=(32, 64, 128)),
    Recipe("int8_wo", QuantFormat.INT8, weight_axis=0),
    Recipe("int8_sq", "int8_sq", "int8_tensor", weight_axis=0, smoothquant_alpha=SMOOTHQUANT_ALPHA),
    Recipe(
        "w8a8",
        "w8a8",
        "int8",  # the int8 format per row of the last dimension: per token, at run time
        weight_axis=0,
        smoothquant_alpha=LLMC_SMOOTHING_STRENGTH,
        smoothquant_fold=True,
    ),
    Recipe("fp8_dynamic", "fp8_dynamic", "fp8_dynamic", weight_axis=0),
    KVCacheRecipe("fp8_kv", QuantFormat.FP8),
    # OCP microscaling, E8M0 scales per block of 32: MXFP4 weight-only (gpt-oss), MXFP8
    # weights with its inputs quantized per block of 32 at run time
    Recipe("mxfp4", "mxfp4"),
    Recipe("mxfp8", "mxfp8", "mxfp8"),
    # FP8 128x128 weight tiles, inputs per token and group of 128 at run time
    Recipe("fp8_block", "fp8_block", "fp8_group", group_sizes=(32, 64, 128)),
    # GPTQ (llm-compressor's default W4A16 algorithm): INT4 groups, codes from the Hessian
    Recipe("int4_gptq", QuantFormat.INT4, group_sizes=(32, 64, 128), gptq=True),
    # ModelOpt's W4A8_AWQ_BETA_CFG: INT4 AWQ weights run as FP8, FP8 static per-tensor inputs
    Recipe("w4a8_awq", "w4a8", QuantFormat.FP8, awq=True, group_sizes=(32, 64, 128)),
    # GPTQ on int8_wo's format (W8A16, one scale per output row): only the codes differ
    Recipe("int8_gptq", QuantFormat.INT8, weight_axis=0, gptq=True),
    # compressed-tensors' W4AFP8 (llm-compressor; vLLM on Hopper): int4_awq's codes and AWQ
    # folds, FP8 inputs per token at run time; its only layout's scale convention by default
    Recipe(
        "w4afp8",
        "w4afp8",
        "fp8_dynamic",
        awq=True,
        group_sizes=(32, 64, 128),
        scales="compressed-tensors",
    ),
)
