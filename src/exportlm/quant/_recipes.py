"""Recipes as records: what :func:`~exportlm.quant.quantize` does to a linear-like module.

A :class:`Recipe` names a weight format, the activation format or none, and the
calibration algorithm with its options (AWQ, SmoothQuant's alpha, the group size
and the group sizes it may take, the per-row axis, the scale convention, the
modules left unquantized by default). A :class:`KVCacheRecipe` names the format of
the KV cache. Formats (:mod:`exportlm.quant.formats`) are numerics and layouts
only; a recipe is looked up by name in the recipe registry
(:mod:`exportlm.quant._recipe_registry`), and this module is the only one that
reads the recipe a :class:`~exportlm.quant.formats.FormatSpec` may still declare
(its deprecated ``recipe`` field: :func:`legacy_recipe`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from exportlm.quant._tensor import FormatId, ScaleConvention, format_name
from exportlm.quant.formats import FormatSpec, get_format
from exportlm.quant.formats._parts import is_token

__all__ = [
    "DEFAULT_EXCLUDE",
    "KVCacheRecipe",
    "Recipe",
    "legacy_kv_recipe",
    "legacy_recipe",
    "recipe_problems",
]

#: Left in full precision unless an override names them: ``lm_head``, MoE routers
#: (``*.gate``, ``*.router``, Qwen's ``shared_expert_gate``) and LoRA adapters.
#: Embeddings are never quantized unless an override pattern names them.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    "*lm_head*",
    "*.gate",
    "gate",
    "*.router",
    "router",
    "*.router.*",  # a router's own linear (DBRX: ffn.router.layer)
    "*shared_expert_gate*",
    "*lora_*",
)


@dataclass(frozen=True)
class Recipe:
    """How one weight recipe quantizes a linear-like module (``quantize(model, name)``).

    Attributes:
        name: the recipe name (``"int4_awq"``): no spaces, no ``+``.
        weight: the weight format (a registered :class:`~exportlm.quant.FormatSpec`'s).
        input: the activation format, or ``None`` for weight-only. It is the weight
            format's ``activations`` (the layouts store no other).
        group_size: the block / group size of a block format (``None``: the
            format's ``block_size``); ``None`` for per-tensor / per-row formats.
        group_sizes: the group sizes the ``group_size`` option takes (``group_size``
            among them); empty: ``group_size`` only.
        weight_axis: ``0`` for per-row weight scales (INT8), ``None`` otherwise.
        awq: compute an AWQ ``pre_quant_scale`` from calibration activations.
        awq_clip: after AWQ's smoothing, search each INT4 group's clipped range on the
            calibration inputs (:mod:`exportlm.quant._awq_clip`; the ``clip`` option).
        smoothquant_alpha: SmoothQuant's migration strength (the ``alpha`` option),
            ``None`` without smoothing.
        smoothquant_fold: smooth only linears whose scale folds into the norm feeding
            them (llm-compressor's ``SmoothQuantModifier``); ``False``: every linear,
            the scale kept as ``pre_quant_scale`` (ModelOpt's).
        symmetric: symmetric scales (no zero point). Every layout exportlm writes is
            symmetric, so a recipe with ``symmetric=False`` is refused when registered.
        scales: the scale convention (the ``scales`` option): ``"modelopt"`` or
            ``"compressed-tensors"``.
        default_exclude: the fnmatch patterns left unquantized unless an override
            names them, when this recipe is the model's default.
        gptq: quantize the weights with GPTQ from the calibration inputs' Hessian
            (:mod:`exportlm.quant._gptq`; INT4 groups or INT8 rows); ``gptq_actorder``
            (``"none"`` / ``"weight"``) and ``gptq_dampening`` are its ``actorder`` /
            ``dampening`` options.
        spelled: the recipe as spelled with its options (``"int4_awq:group_size=64"``);
            empty for the recipe's defaults.

    A recipe with options is this record with the options applied
    (:func:`~exportlm.quant.resolve_algorithm`, :mod:`exportlm.quant._options`).
    """

    name: str
    weight: FormatId
    input: FormatId | None = None
    group_size: int | None = None
    group_sizes: tuple[int, ...] = ()
    weight_axis: int | None = None
    awq: bool = False
    awq_clip: bool = True
    smoothquant_alpha: float | None = None
    smoothquant_fold: bool = False
    symmetric: bool = True
    scales: ScaleConvention = "modelopt"
    default_exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    spelled: str = ""
    gptq: bool = False
    gptq_actorder: str = "weight"
    gptq_dampening: float = 0.01

    @property
    def spelling(self) -> str:
        """The recipe as spelled (``"int4_awq:group_size=64"``, or the name)."""
        return self.spelled or self.name

    @property
    def weight_block(self) -> int | None:
        """The weight's block / group size (the format's ``block_size`` by default)."""
        if self.group_size:
            return self.group_size
        return get_format(self.weight).block_size

    @property
    def allowed_group_sizes(self) -> tuple[int, ...]:
        """The values of the ``group_size`` option (one value: the option is not taken)."""
        block = self.weight_block
        return self.group_sizes or ((block,) if block else ())

    @property
    def quant_algo(self) -> str:
        """The ModelOpt ``quant_algo`` of the weight format (the recipe name without one)."""
        scheme = get_format(self.weight).modelopt
        return self.name if scheme is None else scheme.quant_algo

    @property
    def calibrates(self) -> bool:
        """Its statistics need calibration forwards: activations quantized with a static
        (calibrated) scale, AWQ, SmoothQuant or GPTQ.

        ``False`` for weight-only round-to-nearest (``int8_wo``) and for inputs quantized
        at run time (``fp8_dynamic``): every stored scale comes from the weights, so
        :func:`~exportlm.quant.quantize` runs no forward for it.
        """
        static_inputs = self.input is not None and get_format(self.input).calibrated
        return static_inputs or self.awq or self.smoothquant_alpha is not None or self.gptq


@dataclass(frozen=True)
class KVCacheRecipe:
    """A KV-cache recipe: the format of the ``k_proj`` / ``v_proj`` output quantizers.

    The format declares the KV cache's checkpoint fields (its ``kv_cache`` scheme).
    """

    name: str
    format: FormatId


def recipe_problems(recipe: Recipe | KVCacheRecipe) -> Iterator[str]:
    """What makes ``recipe`` unusable with the registered formats (nothing: it is sound)."""
    if not is_token(recipe.name) or "+" in recipe.name:
        yield f"recipe names have no spaces and no '+' (it combines recipes), got {recipe.name!r}"
    if isinstance(recipe, KVCacheRecipe):
        if get_format(recipe.format).kv_cache is None:
            yield f"format {format_name(recipe.format)!r} declares no KV-cache scheme"
        return
    yield from _weight_problems(recipe, get_format(recipe.weight))


def _weight_problems(recipe: Recipe, spec: FormatSpec) -> Iterator[str]:
    if spec.modelopt is None and spec.compressed_tensors is None:
        yield f"format {spec.name!r} declares no checkpoint scheme (ModelOpt or compressed-tensors)"
    if recipe.group_size and not spec.needs_block:
        yield f"group_size is for block formats; {spec.name!r} is {spec.granularity}-granular"
    if recipe.group_sizes and recipe.weight_block not in recipe.group_sizes:
        yield "group_sizes (the group_size option's values) include its group_size"
    if recipe.input is not None and (
        spec.activations is None or format_name(recipe.input) != format_name(spec.activations)
    ):
        yield (
            f"format {spec.name!r} stores activations as {spec.activations!r} in its layouts, "
            f"so its recipes quantize inputs to that or to nothing, not {recipe.input!r}"
        )
    alpha = recipe.smoothquant_alpha
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        yield f"smoothquant_alpha must be in [0, 1], got {alpha!r}"
    leaves = {leaf.name for leaf in spec.leaves if leaf.role == "activation"}
    if (alpha is not None or recipe.awq) and "pre_quant_scale" not in leaves:
        yield f"AWQ and SmoothQuant write 'pre_quant_scale', and format {spec.name!r} has no such leaf"
    if not recipe.symmetric:
        yield "no layout exportlm writes has a zero point, so a recipe is symmetric=True"
    if recipe.gptq and (format_name(recipe.weight) not in ("int4", "int8") or recipe.awq):
        yield "GPTQ quantizes INT4 or INT8 weights (format 'int4' or 'int8'), without AWQ"


def legacy_recipe(spec: FormatSpec) -> Recipe | None:
    """The :class:`Recipe` of the deprecated ``FormatSpec.recipe`` field, or ``None``."""
    old = spec.recipe
    if old is None:
        return None
    return Recipe(
        old.name,
        spec.format,
        spec.activations if old.quantize_inputs else None,
        group_size=old.block_size,
        group_sizes=old.group_sizes,
        weight_axis=old.axis,
        awq=old.awq,
        smoothquant_alpha=old.smoothquant_alpha,
        smoothquant_fold=old.smoothquant_fold,
    )


def legacy_kv_recipe(spec: FormatSpec) -> KVCacheRecipe | None:
    """The KV-cache recipe a format's ``kv_cache`` scheme names, or ``None``."""
    return None if spec.kv_cache is None else KVCacheRecipe(spec.kv_cache.recipe, spec.format)
