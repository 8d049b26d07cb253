"""What ``quantize`` refuses before converting anything, with why and what to do instead."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.quant._experts import experts_base, has_stacked_weights
from exportlm.quant._recipe import Algorithm, QuantRecipe

__all__ = ["refuse_experts_algorithm", "refuse_unconvertible", "refuse_unplaceable_kv_cache"]

logger = logging.getLogger("exportlm.quant._quantize")


def refuse_unconvertible(name: str, module: nn.Module, recipe: QuantRecipe) -> None:
    """A module the recipe would quantize but that has no wrapper: warn, or refuse experts.

    Stacked expert weights in a layout without a wrapper raise: leaving them
    silently in full precision would export a checkpoint that claims a format
    its experts are not in.
    """
    if recipe.algo_for(name) is None:
        return
    if isinstance(module, nn.Linear):
        logger.warning("%s: %s overrides forward; left unquantized", name, type(module).__name__)
    elif has_stacked_weights(module):
        shapes = ", ".join(
            f"{p} {tuple(t.shape)}" for p, t in module.named_parameters(recurse=False)
        )
        raise UnsupportedFormatError(
            f"module {name!r} ({type(module).__module__}.{type(module).__qualname__}) holds "
            f"stacked expert weights ({shapes}) in a layout exportlm has no quantized wrapper "
            "for (supported: transformers-5 fused experts of Mixtral / Qwen-MoE / GptOss, "
            "Llama4TextExperts, DbrxExperts). Exclude it (exclude=[" + repr(name) + "]) to "
            "keep it in full precision."
        )


def refuse_experts_algorithm(name: str, module: nn.Module, algo: Algorithm) -> None:
    base = experts_base(module)
    problem = None if base is None else base.refuses(algo)
    if problem is not None:
        raise UnsupportedFormatError(
            f"module {name!r} ({type(module).__name__}): {problem}. Quantize it with 'fp8' "
            f"({{{name!r}: 'fp8'}}) or exclude it (exclude=[{name!r}])."
        )


def refuse_unplaceable_kv_cache(
    model: nn.Module, plan: QuantRecipe, conversions: Sequence[Any]
) -> None:
    """A KV-cache recipe on a model without separate ``k_proj`` / ``v_proj`` is refused.

    Silently writing a checkpoint without ``k_scale`` / ``v_scale`` would leave the
    engine's FP8 cache to default scales (vLLM: 1.0), the failure KV scales exist to avoid.
    """
    if plan.kv_cache is None or any(c.kv is not None for c in conversions):
        return
    raise UnsupportedFormatError(
        f"recipe asks for KV-cache quantization ({plan.kv_cache!r}) but "
        f"{type(model).__name__} has no linear named k_proj / v_proj outside the excluded "
        "modules to measure K and V on (fused QKV projections such as DBRX's Wqkv are not "
        "supported for KV-cache scales); quantize without the KV-cache recipe, or unfuse "
        "the projection"
    )
