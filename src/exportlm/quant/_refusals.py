"""What ``quantize`` refuses before converting anything, with why and what to do instead."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from fnmatch import fnmatch
from typing import Any

from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.quant._experts import experts_base, has_stacked_weights
from exportlm.quant._modules import is_quantized_module
from exportlm.quant._recipe import KV_CACHE_FORMATS, Algorithm, QuantRecipe
from exportlm.quant._shape_refusals import every_layer
from exportlm.quant.formats import (
    CHECKPOINT_LAYOUTS,
    CheckpointLayout,
    FormatSpec,
    KVCacheScheme,
    checkpoint_layout,
    formats,
    get_format,
)

__all__ = [
    "check_layout",
    "check_layout_model",
    "check_layout_model_type",
    "refuse_experts_algorithm",
    "refuse_gptq",
    "refuse_unconvertible",
    "refuse_unplaceable_kv_cache",
]

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
    problem = None if base is None else base.refuses(algo) or _tile_problem(module, base, algo)
    modelopt = get_format(algo.weight).modelopt is not None
    keeps_scale = algo.awq and algo.input is not None and not _experts_keep_no_scale(algo)
    if problem is None and keeps_scale:  # w4a8_awq; w4afp8 in ModelOpt's scale convention
        problem = (
            f"recipe {algo.spelling!r} quantizes the inputs after a per-expert AWQ scale, which "
            "the stacked experts' wrappers do not apply in one order yet (the fake-quantized "
            "model would not be what the checkpoint's loader computes)"
        )
        if not modelopt:  # w4afp8: compressed-tensors only, one format per checkpoint
            problem += (
                ", and compressed-tensors, its only layout, has no tensor for a per-expert "
                "AWQ scale"
            )
    if problem is not None:
        raise UnsupportedFormatError(
            f"module {name!r} ({type(module).__name__}): {problem}. "
            f"{_experts_instead(name, algo, modelopt, by_scale=keeps_scale)}"
        )


def refuse_gptq(name: str, kind: str, algo: Algorithm | None) -> None:
    """Refuse a GPTQ recipe on a module that is not a linear (before any conversion), naming
    a pattern for that module in every layer (each refused alike) and a recipe that takes it."""
    if algo is None or not algo.gptq or kind in ("linear", "moe_linear"):
        return
    pattern = every_layer(name)
    instead = "int8_wo" if get_format(algo.weight).name == "int8" else "int4_awq"
    raise UnsupportedFormatError(
        f"module {name!r}: recipe {algo.spelling!r} runs GPTQ, which quantizes linear layers "
        f"from their inputs' Hessian; {kind} modules have no such input. Exclude them in "
        f"every layer (exclude=[{pattern!r}], --exclude {pattern!r}) or give them another "
        f"recipe ({{{pattern!r}: {instead!r}}})."
    )


def _experts_instead(name: str, algo: Algorithm, modelopt: bool, *, by_scale: bool) -> str:
    """What to do about refused experts: never the option ``algo`` already has; the exclusion
    as a pattern for every layer's experts (``*.mlp.experts``), each refused alike."""
    pattern = every_layer(name)
    exclude = f"exclude=[{pattern!r}], --exclude {pattern!r}"
    fp8 = f"quantize it with 'fp8' ({{{pattern!r}: 'fp8'}})"
    if by_scale and not modelopt:  # w4afp8 in ModelOpt's convention
        return (
            f"Quantize with '{algo.name}:scales=compressed-tensors' (the convention that keeps "
            f"no per-expert scale, its default) or exclude it ({exclude})."
        )
    if algo.scales == "compressed-tensors":  # the compressed-tensors layout's convention
        tail = f", or, exported with format='modelopt', {fp8}" if modelopt else ""
        return f"Exclude it ({exclude}){tail}."
    if modelopt:
        return f"Quantize it with 'fp8' ({{{pattern!r}: 'fp8'}}) or exclude it ({exclude})."
    return f"Exclude it ({exclude})."


def _experts_keep_no_scale(algo: Algorithm) -> bool:
    """Under compressed-tensors' scale convention stacked experts keep no AWQ scale (each
    expert's ``down_proj`` scale is folded into its ``up`` rows, the rest is round-to-nearest:
    :mod:`exportlm.quant._fold_experts`), so inputs quantized at run time (``w4afp8``'s FP8
    per token) see what the checkpoint's loader computes; static input scales (``w4a8_awq``)
    were calibrated before the fold and are still refused."""
    return algo.scales == "compressed-tensors" and not (
        algo.input is not None and get_format(algo.input).calibrated
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


def _tile_problem(module: nn.Module, base: Any, algo: Algorithm) -> str | None:
    """Why square weight tiles (``fp8_block``) cannot cover fused gate/up experts, or ``None``.

    The fused ``gate_up_proj`` is quantized whole, but the checkpoint holds gate and up as
    two weights: their tiles are the fused tensor's only when no tile mixes gate and up rows
    (gate rows first, the intermediate size a multiple of the block; vLLM's block-FP8 MoE
    asks the same of its gate/up partitions).
    """
    block = algo.weight_block
    if get_format(algo.weight).granularity != "tile" or not block:
        return None
    if not getattr(base, "stores_fused_parameters", False):
        return None
    if not getattr(module, "is_concatenated", not base.default_interleaved):
        return (
            f"its gate_up_proj interleaves gate and up rows, so {block}x{block} tiles of recipe "
            f"{algo.spelling!r} would mix the two weights the checkpoint stores apart"
        )
    rows = dict((p, out) for p, out, _ in base.weight_dims(module))["gate_up_proj"]
    if (rows // 2) % block:
        return (
            f"its intermediate size {rows // 2} is not a multiple of the tile {block} of recipe "
            f"{algo.spelling!r}, so a tile would mix gate and up rows"
        )
    return None


def check_layout(recipe: QuantRecipe, layout: str) -> None:
    """A recipe whose formats the checkpoint layout ``layout`` cannot hold, refused up front.

    The writer refuses the same at the end of an export; checked here, before the model
    is loaded or calibrated, a refusal costs nothing (``--quantize w8a8`` in the default
    ModelOpt layout used to fail after minutes of calibration).

    (Mixed precision in compressed-tensors is refused by the writer: which formats a
    model mixes depends on which modules the patterns match.)

    Raises:
        UnsupportedFormatError: naming the recipe, the layout and the layouts that hold it.
        ValueError: an unknown layout name.
    """
    holder = checkpoint_layout(layout)
    algos = recipe.algorithms()
    kv = None if recipe.kv_cache is None else get_format(KV_CACHE_FORMATS[recipe.kv_cache])
    for algo in algos:
        spec = get_format(algo.weight)
        if (spec.modelopt if holder.scheme is None else getattr(spec, holder.scheme)) is None:
            instead = f"; {spec.modelopt_instead}" if spec.modelopt_instead else ""
            raise UnsupportedFormatError(
                f"recipe {algo.spelling!r} cannot be written in the {layout} checkpoint layout "
                f"(its format {spec.name!r} declares no scheme there); {_layouts_of(spec)}"
                + (instead if holder.scheme is None else "")
            )
        block = spec.modelopt_block_problem(algo.weight_block) if holder.scheme is None else None
        if block is not None:
            raise UnsupportedFormatError(f"recipe {algo.spelling!r}: {block}")
    kv_scheme = None if kv is None else kv.kv_cache
    if holder.scheme is not None and kv_scheme is not None and not _kv_held(kv_scheme, holder):
        raise UnsupportedFormatError(
            f"format={layout!r} cannot hold the KV-cache recipe {recipe.kv_cache!r}; "
            "use format='modelopt'"
        )


def _kv_held(kv_scheme: KVCacheScheme, layout: CheckpointLayout) -> bool:
    """``layout`` (a scheme's) has fields for the KV-cache scheme (compressed-tensors' own)."""
    return getattr(kv_scheme, str(layout.scheme), None) is not None


def _layouts_of(spec: FormatSpec) -> str:
    names = [n for n, lay in CHECKPOINT_LAYOUTS.items() if lay.holds(spec)]
    names = [n for n in names if n != "modelopt" or spec.modelopt is not None]
    if not names:
        return "no checkpoint layout holds it"
    return "export with " + " or ".join(f"-o format={n} (format={n!r})" for n in names)


def check_layout_model_type(model_type: object, layout: str, what: str) -> None:
    """A model whose ``config.json`` ``model_type`` the layout's loaders do not read it for.

    ``what`` names the model in the message (its class, or its directory). Refused before
    a weight is read: gpt-oss-mxfp4 is read only for ``gpt_oss`` (transformers' Mxfp4
    quantizer replaces ``GptOssMLP`` only; vLLM's ``GptOssMxfp4Config`` matches that
    ``model_type`` only, ``docs/checkpoint-format.md``).
    """
    holder = checkpoint_layout(layout)
    if not holder.model_types or model_type in holder.model_types:
        return
    held = [spec for spec in formats() if holder.holds(spec)]
    others = [
        n
        for n, other in CHECKPOINT_LAYOUTS.items()
        if not other.model_types and any(_scheme_of(s, other) is not None for s in held)
    ]
    instead = " or ".join(f"-o format={n} (format={n!r})" for n in others) or "another layout"
    raise UnsupportedFormatError(
        f"format={layout!r} is the layout of {' / '.join(holder.model_types)} models only "
        f"(its loaders read it for config.json model_type {' / '.join(holder.model_types)}), "
        f"but {what} has model_type {model_type!r}; export with {instead}"
    )


def check_layout_model(model: nn.Module, layout: str) -> None:
    """A model in memory the layout cannot hold, refused before anything is written.

    Its ``model_type`` (:func:`check_layout_model_type`); and where the layout quantizes
    only some modules (:attr:`CheckpointLayout.quantized_modules`), a quantized model must
    quantize exactly those: another quantized module (an MXFP4 ``q_proj``) has no tensors
    in the layout, and one of those left in float would be misread (vLLM's
    ``Mxfp4Config`` reads every experts module as MXFP4 and no ``modules_to_not_convert``).
    """
    holder = checkpoint_layout(layout)
    config = getattr(model, "config", None)
    check_layout_model_type(getattr(config, "model_type", None), layout, type(model).__name__)
    if not holder.quantized_modules:
        return
    quantized = {n for n, m in model.named_modules() if is_quantized_module(m)}
    if not quantized:
        return  # an unquantized model: a plain checkpoint, no quantization config
    patterns = holder.quantized_modules
    held = {n for n, _ in model.named_modules() if any(fnmatch(n, p) for p in patterns)}
    extra, missing = sorted(quantized - held), sorted(held - quantized)
    if extra or missing:
        what = f"quantizes {extra[0]}" if extra else f"leaves {missing[0]} unquantized"
        raise UnsupportedFormatError(
            f"format={layout!r} quantizes exactly the modules {list(patterns)}, every one of "
            f"them, but the model {what}; quantize it with "
            f"QuantRecipe.parse(recipe).for_layout({layout!r}) (the CLI's --quantize with "
            f"-o format={layout} does), or export with -o format=modelopt (format='modelopt')"
        )


def _scheme_of(spec: FormatSpec, layout: CheckpointLayout) -> object:
    return spec.modelopt if layout.scheme is None else getattr(spec, layout.scheme)
