"""``quantize``: convert a model's modules to quantized wrappers and calibrate them."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from exportlm.errors import QuantizationError, UnsupportedFormatError
from exportlm.quant._calibrate import (
    check_calibrated,
    check_finite,
    unify_expert_input_amax,
    unify_groups,
)
from exportlm.quant._calibration_steps import calibrate_and_smooth, init_weight_amax
from exportlm.quant._conventions import apply_convention
from exportlm.quant._expert_modules import QuantExperts
from exportlm.quant._experts import experts_base, quant_experts_class
from exportlm.quant._gemm import check_setting as check_gemm_setting
from exportlm.quant._gemm import float32_matmuls
from exportlm.quant._gptq_apply import mark_gptq
from exportlm.quant._kv import route_kv_cache_to_attention
from exportlm.quant._modules import (
    QuantEmbedding,
    QuantLinear,
    QuantModule,
    QuantMoELinear,
)
from exportlm.quant._options import OptionValue
from exportlm.quant._quantizer import TensorQuantizer
from exportlm.quant._recipe import Algorithm, QuantRecipe, RecipeLike, resolve_algorithm
from exportlm.quant._refusals import (
    refuse_experts_algorithm,
    refuse_gptq,
    refuse_unconvertible,
    refuse_unplaceable_kv_cache,
)
from exportlm.quant._shape_refusals import refuse_shapes
from exportlm.quant._tensor import FormatId, QuantFormat
from exportlm.quant._transaction import quantize_transaction
from exportlm.quant.formats import get_format

__all__ = [
    "check_recipe",
    "iterable_expert_lists",
    "quantize",
    "unify_expert_input_amax",
    "wrap_module",
]

logger = logging.getLogger(__name__)


@dataclass
class _Conversion:
    name: str
    module: nn.Module
    algo: Algorithm | None
    kv: FormatId | None
    kind: str  # "linear" | "moe_linear" | "embedding" | "experts"
    kv_min_scale: float | None = None  # a floor of the KV-cache scales (recipe option)


def quantize(
    model: nn.Module,
    recipe: RecipeLike,
    calibrate: Callable[[nn.Module], object] | None = None,
    *,
    exclude: Sequence[str] | None = None,
    inplace: bool = True,
    **options: OptionValue,
) -> nn.Module:
    """Fake-quantize ``model`` following ``recipe``; returns the quantized model.

    Args:
        model: any ``nn.Module``; ``nn.Linear``, transformers-5 fused experts and
            (when an override names them) ``nn.Embedding`` are converted.
        recipe: ``"fp8"``, ``"nvfp4"``, ``"int4_awq"``, ``"int8_wo"`` (or the recipe
            of a format added with :func:`~exportlm.quant.register_format`), optionally
            combined with ``"fp8_kv"`` (``"fp8+fp8_kv"`` or ``["fp8", "fp8_kv"]``),
            a mapping of module-name patterns to recipes for mixed precision
            (``{"*": "fp8", "*.mlp.*": "nvfp4"}``) or a :class:`QuantRecipe`.
            ``lm_head``, MoE routers and embeddings stay unquantized by default.
        calibrate: ``calibrate(model)`` runs the calibration forwards (max
            calibration of activations). Default: one forward on deterministic
            ``input_ids`` from :func:`exportlm.export.make_input_ids`. A weight-only
            recipe (``int8_wo``) never calls it: every scale comes from the weights. AWQ recipes
            call it twice (statistics, then the scale search), so it must run the
            same forwards on every call; see ``docs/checkpoint-format.md`` for how
            the AWQ scales are chosen.
        exclude: extra fnmatch patterns of module names never quantized.
        inplace: convert ``model`` itself (default) or a deep copy of it.
        options: options of the default weight recipe, e.g. ``group_size=64`` for
            ``int4_awq`` on input features not divisible by 128, ``alpha=0.5`` for a
            SmoothQuant recipe (the same as spelling ``"int4_awq:group_size=64"``;
            see ``docs/checkpoint-format.md``). An unknown option raises
            :class:`~exportlm.errors.UnknownOptionError` naming the known ones.

    After calibration, linears that read the same input inside one parent
    (``q/k/v_proj``, ``gate/up_proj``) share their input amax and per-tensor weight
    amax (what fused-QKV / fused-gate-up kernels need, as ModelOpt exports them),
    and the experts of one iterable MoE block share their input amax.

    Raises:
        UnknownNameError: an unknown recipe name.
        UnsupportedFormatError: a format a module's shape cannot take (e.g. NVFP4
            on an input dimension not divisible by 16); nothing is converted then.
        QuantizationError: an already quantized model, a non-finite amax (NaN/inf
            weights or activations), an activation quantizer that calibration never
            reached, or an exception from ``calibrate`` (chained). The message says
            which step failed.

    Quantizing in place is all or nothing: when conversion, calibration or the
    final check fails, every module of ``model`` is restored (its type, plain
    attributes, children, the same parameter objects, buffer values) and
    ``quantize`` can be called on it again. With ``inplace=False`` the original
    is never modified.
    """
    plan = QuantRecipe.parse(recipe, exclude, options)
    check_gemm_setting()
    if not inplace:
        model = copy.deepcopy(model)
    conversions = _checked_plan(model, plan)
    with quantize_transaction(model) as steps:
        with steps.step("conversion"):
            for conversion in conversions:
                _convert(conversion)
            route_kv_cache_to_attention(model)  # K / V quantized where they are cached
            init_weight_amax(model)
        groups: list[list[QuantLinear]] = []
        if _calibrates(conversions):
            awq = any(c.algo is not None and c.algo.awq for c in conversions)
            with float32_matmuls(model):  # a bf16 model on an AVX2 CPU: 9x faster
                groups = calibrate_and_smooth(model, calibrate, steps, awq)
        else:
            logger.info("weight-only recipe: every scale comes from the weights; no calibration")
        with steps.step("amax unification"):
            unify_groups(model, groups)
            for experts in iterable_expert_lists(model).values():
                for quantizer, amax in unify_expert_input_amax(experts).items():
                    quantizer.amax = amax
        with steps.step("the final check of the calibrated quantizers"):
            check_calibrated(model)
            check_finite(model)
    logger.info("quantized %d module(s) of %s", len(conversions), type(model).__name__)
    return model


def check_recipe(
    model: nn.Module,
    recipe: RecipeLike,
    *,
    exclude: Sequence[str] | None = None,
    **options: OptionValue,
) -> bool:
    """Refuse what :func:`quantize` would refuse before converting, changing nothing.

    The recipe, its options and every module's shape are checked, on a model whose
    weights may be on the ``meta`` device (a skeleton built from ``config.json``), so a
    refusal costs no loading and no calibration. Returns whether the recipe runs
    calibration forwards (``False``: weight-only, every scale from the weights).

    Raises what :func:`quantize` raises for them (``UnknownNameError``,
    ``UnknownOptionError``, ``UnsupportedFormatError``, ``QuantizationError``).
    """
    return _calibrates(_checked_plan(model, QuantRecipe.parse(recipe, exclude, options)))


def _checked_plan(model: nn.Module, plan: QuantRecipe) -> list[_Conversion]:
    conversions = list(_plan(model, plan))
    refuse_unplaceable_kv_cache(model, plan, conversions)
    for c in conversions:
        refuse_shapes(c, conversions)
        refuse_gptq(c.name, c.kind, c.algo)
    return conversions


def _calibrates(conversions: Sequence[_Conversion]) -> bool:
    """Some module needs calibration forwards (activations, AWQ, SmoothQuant or KV scales)."""
    return any(c.kv is not None or (c.algo is not None and c.algo.calibrates) for c in conversions)


def wrap_module(module: nn.Module, name: str = "") -> QuantModule:
    """Convert one module in place to its quantized wrapper, every quantizer disabled.

    ``module`` is an ``nn.Linear`` (-> :class:`QuantLinear`), ``nn.Embedding``
    (-> :class:`QuantEmbedding`) or stacked experts (transformers-5 fused / BMM,
    Llama4, DBRX -> ``Quant<Experts>``, a :class:`QuantExperts`).
    Disabled quantizers pass tensors through, so the wrapper computes what the
    module did (through the wrapper's forward); enable single quantizers with
    :meth:`TensorQuantizer.load_scale`. This is how a checkpoint runtime
    re-applies exported activation scales to weights it has already dequantized.
    ``name`` labels the quantizers in error messages.

    Raises:
        QuantizationError: ``module`` is already quantized.
        UnsupportedFormatError: ``module`` has no quantized wrapper.
    """
    where = name or type(module).__name__
    if isinstance(module, QuantModule):
        raise QuantizationError(f"{where} is already quantized ({type(module).__name__})")
    kind = _kind(where, module, {})
    if kind is None:
        raise UnsupportedFormatError(
            f"{where} ({type(module).__name__}) has no quantized wrapper; expected an "
            "nn.Linear or nn.Embedding without a custom forward, or transformers-5 fused experts"
        )
    _convert(_Conversion(name, module, None, None, kind))
    if not isinstance(module, QuantModule):  # pragma: no cover - _convert always swaps the class
        raise QuantizationError(f"{where}: conversion did not produce a quantized wrapper")
    return module


# -- planning -----------------------------------------------------------------
def _plan(model: nn.Module, recipe: QuantRecipe) -> Iterator[_Conversion]:
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if isinstance(module, QuantModule):
            raise QuantizationError(
                f"{name or type(model).__name__} is already quantized "
                f"({type(module).__name__}); quantize the original model, or pass "
                "inplace=False on an unquantized one"
            )
        kind = _kind(name, module, modules)
        if kind is None:
            refuse_unconvertible(name, module, recipe)
            continue
        _refuse_stored_codes(name or type(model).__name__, module)
        algo_name = recipe.algo_for(name, default_applies=kind != "embedding")
        algo = resolve_algorithm(algo_name) if algo_name else None
        if kind == "experts" and algo is not None:
            refuse_experts_algorithm(name, module, algo)
        kv = recipe.kv_for(name) if kind == "linear" and _kv_role(name) else None
        if algo is not None or kv is not None:
            yield _Conversion(name, module, algo, kv, kind, recipe.kv_cache_min_scale)


#: The dtypes a float model's weights have; anything else is a quantized model's codes.
_FLOAT_WEIGHTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _refuse_stored_codes(name: str, module: nn.Module) -> None:
    """Refuse a module whose weights are codes: a quantized checkpoint transformers loaded
    (compressed-tensors' FP8 as float8_e4m3fn, packed int4 as int32), not a float model."""
    for leaf, param in module.named_parameters(recurse=False):
        if param.dtype not in _FLOAT_WEIGHTS:
            raise QuantizationError(
                f"{name}.{leaf} is {param.dtype}: the model is already quantized (a "
                "quantized checkpoint as loaded by transformers); quantize the float model "
                "it was made from (bfloat16, float16 or float32 weights)"
            )


def _kind(name: str, module: nn.Module, modules: dict[str, nn.Module]) -> str | None:
    if experts_base(module) is not None:
        return "experts"
    if isinstance(module, nn.Linear):
        if type(module).forward is not nn.Linear.forward:
            return None  # a custom forward would bypass the quantizers
        return "moe_linear" if _in_expert_list(name, modules) else "linear"
    if isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward:
        return "embedding"
    return None


def _in_expert_list(name: str, modules: dict[str, nn.Module]) -> bool:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "experts" and isinstance(modules.get(".".join(parts[: i + 1])), nn.ModuleList):
            return True
    return False


def iterable_expert_lists(model: nn.Module) -> dict[str, nn.ModuleList]:
    """``{name: experts}`` of every ``nn.ModuleList`` named ``experts`` holding MoE linears."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and name.rsplit(".", 1)[-1] == "experts"
        and any(isinstance(m, QuantMoELinear) for m in module.modules())
    }


def _kv_role(name: str) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    return {"k_proj": "k", "v_proj": "v"}.get(leaf)


# -- conversion ---------------------------------------------------------------
def _weight_quantizer(algo: Algorithm | None, label: str, per_expert: bool) -> TensorQuantizer:
    if algo is None:
        return TensorQuantizer(QuantFormat.FP8, enabled=False, label=label)
    axis = 0 if per_expert else algo.weight_axis
    quantizer = TensorQuantizer(algo.weight, axis=axis, block_size=algo.weight_block, label=label)
    quantizer.recipe = algo.spelling  # what a refusal names: its format may have other recipes
    quantizer.awq_clip = algo.awq and algo.awq_clip
    return quantizer


def _input_quantizer(algo: Algorithm | None, label: str) -> TensorQuantizer:
    if algo is None or algo.input is None:
        quantizer = TensorQuantizer(QuantFormat.FP8, enabled=False, label=label)
        quantizer.track_channels = bool(algo and algo.awq)
        return quantizer
    block = algo.weight_block if get_format(algo.input).needs_block else None
    quantizer = TensorQuantizer(algo.input, block_size=block, label=label)
    quantizer.track_channels = algo.awq  # w4a8_awq: AWQ statistics of quantized inputs
    return quantizer


def _convert(c: _Conversion) -> None:
    module: Any = c.module
    algo = c.algo
    _convert_kind(c)
    apply_convention(module, algo)
    mark_gptq(module, algo)


def _convert_kind(c: _Conversion) -> None:
    module: Any = c.module
    algo = c.algo
    if c.kind == "experts":
        base = experts_base(module)
        if base is None:  # pragma: no cover - _kind only plans experts it has a base for
            raise QuantizationError(f"{c.name}: {type(module).__name__} has no experts wrapper")
        module.__class__ = quant_experts_class(type(module), base)
        for proj in QuantExperts.PROJECTIONS:
            setattr(
                module,
                f"{proj}_weight_quantizer",
                _weight_quantizer(algo, f"{c.name}.{proj}_weight_quantizer", True),
            )
            input_quantizer = _input_quantizer(algo, f"{c.name}.{proj}_input_quantizer")
            if algo is not None and algo.awq:  # one AWQ scale per expert, from its tokens
                input_quantizer.channel_experts = int(module.num_experts)
            setattr(module, f"{proj}_input_quantizer", input_quantizer)
    elif c.kind == "embedding":
        module.__class__ = QuantEmbedding
        module.weight_quantizer = _weight_quantizer(algo, f"{c.name}.weight_quantizer", False)
    else:
        module.__class__ = QuantMoELinear if c.kind == "moe_linear" else QuantLinear
        module.weight_quantizer = _weight_quantizer(algo, f"{c.name}.weight_quantizer", False)
        module.input_quantizer = _input_quantizer(algo, f"{c.name}.input_quantizer")
        output = TensorQuantizer(
            c.kv or QuantFormat.FP8,
            enabled=c.kv is not None,
            label=f"{c.name}.output_quantizer",
            min_scale=c.kv_min_scale,
        )
        output.kv_role = _kv_role(c.name) if c.kv is not None else None
        module.output_quantizer = output
    module.quant_algo = algo.quant_algo if algo else None
    module.group_size = algo.weight_block if algo else None
    if algo is not None and algo.smoothquant_alpha is not None:
        module.smoothquant_alpha = algo.smoothquant_alpha  # the recipe's, options applied
        module.smoothquant_fold = algo.smoothquant_fold
