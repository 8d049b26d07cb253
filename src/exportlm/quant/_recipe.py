"""Quantization recipes: which algorithm each module gets.

A recipe is a default algorithm, an optional KV-cache format, per-module
overrides (mixed precision) and exclusions, all as fnmatch patterns over module
names (``model.layers.0.mlp.down_proj``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from exportlm.errors import UnknownNameError, UnknownOptionError
from exportlm.quant._options import (
    OptionValue,
    apply_options,
    known_options,
    spell,
    split_options,
)
from exportlm.quant._tensor import FormatId, ScaleConvention
from exportlm.quant.formats import FormatSpec, formats, get_format

__all__ = [
    "ALGORITHMS",
    "DEFAULT_EXCLUDE",
    "KV_CACHE_FORMATS",
    "Algorithm",
    "QuantRecipe",
    "RecipeLike",
    "recipe_names",
    "resolve_algorithm",
]

_V = TypeVar("_V")


@dataclass(frozen=True)
class Algorithm:
    """How one weight algorithm quantizes a linear-like module.

    Attributes:
        name: the recipe name (``"fp8"``).
        quant_algo: the ModelOpt ``quant_algo`` written to ``hf_quant_config.json`` (the
            recipe name for a format without a ModelOpt scheme).
        weight: the weight format.
        weight_block: NVFP4 block / INT4 group size, ``None`` for per-tensor / per-row.
        weight_axis: ``0`` for per-row weight scales (INT8), ``None`` otherwise.
        input: the activation format, or ``None`` for weight-only.
        awq: compute an AWQ ``pre_quant_scale`` from calibration activations.
        smoothquant_alpha: SmoothQuant's migration strength, ``None`` without smoothing.
        group_sizes: the group sizes the ``group_size`` option takes (block recipes).
        scales: how the calibrated scales are computed and stored (the ``scales``
            option): ``"modelopt"`` (default) or ``"compressed-tensors"`` (NVFP4's global
            scale as compressed-tensors computes it, the other float scales in the weight's
            dtype), exact in the layout of that name.
        spelled: the recipe as spelled with its options (``"int4_awq:group_size=64"``);
            empty for the recipe's defaults.

    A recipe with options is this record with the options applied
    (:func:`resolve_algorithm`, :mod:`exportlm.quant._options`).
    """

    name: str
    quant_algo: str
    weight: FormatId
    weight_block: int | None = None
    weight_axis: int | None = None
    input: FormatId | None = None
    awq: bool = False
    smoothquant_alpha: float | None = None
    group_sizes: tuple[int, ...] = ()
    spelled: str = ""
    scales: ScaleConvention = "modelopt"

    @property
    def spelling(self) -> str:
        """The recipe as spelled (``"int4_awq:group_size=64"``, or the name)."""
        return self.spelled or self.name

    @property
    def calibrates(self) -> bool:
        """Its statistics need calibration forwards: activations quantized with a static
        (calibrated) scale, AWQ or SmoothQuant.

        ``False`` for weight-only round-to-nearest (``int8_wo``) and for inputs quantized
        at run time (``fp8_dynamic``): every stored scale comes from the weights, so
        :func:`~exportlm.quant.quantize` runs no forward for it.
        """
        static_inputs = self.input is not None and get_format(self.input).calibrated
        return static_inputs or self.awq or self.smoothquant_alpha is not None

    @property
    def group_size(self) -> int | None:
        """The ``group_size`` of ``hf_quant_config.json`` (block-quantized formats only)."""
        return self.weight_block

    @classmethod
    def of(cls, spec: FormatSpec) -> Algorithm:
        """The algorithm of ``spec``'s weight recipe (``ValueError`` when it has none)."""
        recipe, modelopt = spec.recipe, spec.modelopt
        if recipe is None:
            raise ValueError(f"format {spec.name!r} has no weight recipe")
        return cls(
            recipe.name,
            recipe.name if modelopt is None else modelopt.quant_algo,
            spec.format,
            recipe.block_size,
            recipe.axis,
            (recipe.input_format or spec.format) if recipe.quantize_inputs else None,
            recipe.awq,
            recipe.smoothquant_alpha,
            recipe.group_sizes or ((recipe.block_size,) if recipe.block_size else ()),
        )


class _RecipeTable(Mapping[str, _V]):
    """A read-only ``{recipe name: value}`` view, rebuilt from the registered formats."""

    def __init__(self, build: Callable[[], dict[str, _V]]) -> None:
        self._build = build

    def __getitem__(self, name: str) -> _V:
        return self._build()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())

    def __repr__(self) -> str:
        return repr(self._build())


def _algorithms() -> dict[str, Algorithm]:
    return {s.recipe.name: Algorithm.of(s) for s in formats() if s.recipe is not None}


def _kv_cache_formats() -> dict[str, FormatId]:
    return {s.kv_cache.recipe: s.format for s in formats() if s.kv_cache is not None}


#: Weight algorithms by recipe name, read from the registered formats
#: (:mod:`exportlm.quant.formats`): ``fp8`` matches ModelOpt's ``FP8_DEFAULT_CFG``
#: (weights and inputs per-tensor E4M3); ``nvfp4`` its ``NVFP4_DEFAULT_CFG`` (E2M1
#: blocks of 16, weights and inputs); ``int4_awq`` is W4A16 with groups of 128;
#: ``int8_wo`` is W8A16 with per-row scales; plus the recipes of registered formats.
ALGORITHMS: Mapping[str, Algorithm] = _RecipeTable(_algorithms)

#: KV-cache recipes: name -> format of the ``k_proj`` / ``v_proj`` output quantizers
#: (``fp8_kv`` -> fp8), read from the registered formats.
KV_CACHE_FORMATS: Mapping[str, FormatId] = _RecipeTable(_kv_cache_formats)

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

RecipeLike = Any  # str | Sequence[str] | Mapping[str, str | None] | QuantRecipe


def resolve_algorithm(spelled: str) -> Algorithm:
    """The :class:`Algorithm` of a recipe part as spelled, options applied (``"int4_awq:group_size=64"``).

    Raises :class:`~exportlm.errors.UnknownNameError` (unknown recipe),
    :class:`~exportlm.errors.UnknownOptionError` or ``ValueError`` (see
    :func:`~exportlm.quant._options.apply_options`).
    """
    name, options = split_options(spelled)
    if name not in ALGORITHMS:
        raise UnknownNameError("quantization recipe", name, recipe_names())
    algo = ALGORITHMS[name]
    return apply_options(algo, options) if options else algo


def recipe_names() -> list[str]:
    """Every recipe name accepted by :func:`~exportlm.quant.quantize`, sorted."""
    return sorted([*ALGORITHMS, *KV_CACHE_FORMATS])


@dataclass(frozen=True)
class QuantRecipe:
    """What :func:`~exportlm.quant.quantize` does to each module.

    Attributes:
        algo: the default weight algorithm (a key of :data:`ALGORITHMS`) or ``None``.
        kv_cache: a key of :data:`KV_CACHE_FORMATS` or ``None``.
        overrides: ``(pattern, algo or None)`` pairs; the *last* pattern matching
            a module name wins and beats the default exclusions (``None`` excludes).
        exclude: patterns never quantized (beat everything, KV cache included).
        default_exclude: patterns left unquantized unless an override names them.
        kv_cache_min_scale: a floor of the KV-cache scales (``k_scale`` /
            ``v_scale``). ``None`` (default) writes ``amax / 448`` as ModelOpt does;
            ``1.0`` reproduces engines' "unit scale unless the data needs more".
    """

    algo: str | None = "fp8"
    kv_cache: str | None = None
    overrides: tuple[tuple[str, str | None], ...] = ()
    exclude: tuple[str, ...] = ()
    default_exclude: tuple[str, ...] = field(default=DEFAULT_EXCLUDE)
    kv_cache_min_scale: float | None = None

    def __post_init__(self) -> None:
        for algo in (self.algo, *(a for _, a in self.overrides)):
            if algo is not None:
                resolve_algorithm(algo)  # an unknown name, option or value raises
        if self.kv_cache is not None and self.kv_cache not in KV_CACHE_FORMATS:
            raise UnknownNameError("quantization recipe", self.kv_cache, recipe_names())
        floor = self.kv_cache_min_scale
        if floor is not None and not (math.isfinite(floor) and floor > 0):
            raise ValueError(
                f"kv_cache_min_scale must be a finite positive number or None, got {floor!r}"
            )

    @classmethod
    def parse(
        cls,
        recipe: RecipeLike,
        exclude: Sequence[str] | None = None,
        options: Mapping[str, OptionValue] | None = None,
    ) -> QuantRecipe:
        """Build a recipe from its short forms.

        ``"fp8"``; ``"fp8+fp8_kv"`` or ``["fp8", "fp8_kv"]`` (combined); a part with
        options, ``"int4_awq:group_size=64"``; a mapping of fnmatch patterns to
        recipes, where ``"*"`` gives the default, e.g. ``{"*": "fp8+fp8_kv",
        "*.mlp.*": "nvfp4", "*.o_proj": None}``; or a :class:`QuantRecipe`.
        ``exclude`` adds patterns never quantized; ``options`` apply to the default
        weight recipe (``group_size=64``).
        Unknown names raise :class:`~exportlm.errors.UnknownNameError`, unknown
        options :class:`~exportlm.errors.UnknownOptionError` naming the known ones.
        """
        extra = tuple(exclude or ())
        if isinstance(recipe, QuantRecipe):
            base = recipe
        elif isinstance(recipe, Mapping):
            base = cls._from_mapping(recipe)
        else:
            algo, kv = _split_parts(recipe)
            base = cls(algo=algo, kv_cache=kv)
        if options:
            base = base.with_options(options)
        if extra:
            return dataclasses.replace(base, exclude=base.exclude + extra)
        return base

    def with_options(self, options: Mapping[str, OptionValue]) -> QuantRecipe:
        """This recipe with ``options`` added to its default weight recipe's."""
        if self.algo is None:
            raise ValueError(
                f"recipe options {dict(options)!r} apply to the default weight recipe, and this "
                "recipe has none; spell them on a part instead ('int4_awq:group_size=64')"
            )
        name, own = split_options(self.algo)
        spelled = resolve_algorithm(spell(name, {**own, **options})).spelling  # canonical values
        return dataclasses.replace(self, algo=spelled)

    def for_layout(self, layout: str) -> QuantRecipe:
        """This recipe with the scale convention of checkpoint layout ``layout``.

        ``"compressed-tensors"``: every weight recipe that takes the ``scales`` option
        and does not spell it gets ``scales=compressed-tensors``, so the checkpoint holds
        the calibrated model exactly (``docs/checkpoint-format.md``); other layouts: the
        recipe as it is. The CLI's ``export`` applies it from ``-o format=``.
        """
        if layout != "compressed-tensors":
            return self

        def convert(spelled: str | None) -> str | None:
            if spelled is None:
                return None
            name, options = split_options(spelled)
            if "scales" in options or "scales" not in known_options(ALGORITHMS[name]):
                return spelled
            return spell(name, {**options, "scales": "compressed-tensors"})

        return dataclasses.replace(
            self,
            algo=convert(self.algo),
            overrides=tuple((pattern, convert(a)) for pattern, a in self.overrides),
        )

    def algorithms(self) -> list[Algorithm]:
        """Every weight recipe this recipe applies (the default and the overrides), once each."""
        spelled = {a: None for a in (self.algo, *(a for _, a in self.overrides)) if a is not None}
        return [resolve_algorithm(a) for a in spelled]

    @classmethod
    def _from_mapping(cls, mapping: Mapping[str, Any]) -> QuantRecipe:
        algo: str | None = None
        kv: str | None = None
        overrides: list[tuple[str, str | None]] = []
        for pattern, value in mapping.items():
            if pattern == "*":
                algo, kv = _split_parts(value) if value is not None else (None, None)
                continue
            if value is None:
                overrides.append((pattern, None))
                continue
            sub_algo, sub_kv = _split_parts(value)
            if sub_kv is not None:
                raise ValueError(
                    f"recipe pattern {pattern!r}: KV-cache recipes ({sub_kv!r}) apply to the "
                    "whole model; put them under the '*' key, e.g. {'*': 'fp8+fp8_kv'}"
                )
            overrides.append((pattern, sub_algo))
        return cls(algo=algo, kv_cache=kv, overrides=tuple(overrides))

    def algo_for(self, name: str, *, default_applies: bool = True) -> str | None:
        """The weight algorithm of module ``name``, or ``None`` to leave it unquantized.

        ``default_applies=False`` (embeddings) quantizes only on an explicit override.
        """
        if _matches(name, self.exclude):
            return None
        for pattern, algo in reversed(self.overrides):
            if fnmatch.fnmatchcase(name, pattern):
                return algo
        if not default_applies or _matches(name, self.default_exclude):
            return None
        return self.algo

    def kv_for(self, name: str) -> FormatId | None:
        """The KV-cache format of module ``name`` (a ``k_proj`` / ``v_proj``), or ``None``."""
        if self.kv_cache is None or _matches(name, self.exclude):
            return None
        return KV_CACHE_FORMATS[self.kv_cache]


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _split_parts(recipe: Any) -> tuple[str | None, str | None]:
    if isinstance(recipe, str):
        parts = [p.strip() for p in recipe.split("+") if p.strip()]
    elif isinstance(recipe, Sequence):
        parts = [str(p) for p in recipe]
    else:
        raise TypeError(
            f"a quantization recipe is a name, a list of names, a mapping of patterns or a "
            f"QuantRecipe; got {type(recipe).__name__}"
        )
    algo: str | None = None
    kv: str | None = None
    for part in parts:
        name, options = split_options(part)
        if name in KV_CACHE_FORMATS:
            if options:
                raise UnknownOptionError(f"quantization recipe {name!r}", list(options), [])
            kv = name
        elif name in ALGORITHMS:
            spelled = resolve_algorithm(spell(name, options)).spelling
            if algo is not None and algo != spelled:
                raise ValueError(
                    f"recipe {recipe!r} names two weight algorithms ({algo!r}, {spelled!r}); "
                    "use a mapping of module patterns for mixed precision"
                )
            algo = spelled
        else:
            raise UnknownNameError("quantization recipe", name, recipe_names())
    if not parts:
        raise ValueError("empty quantization recipe; expected e.g. 'fp8' or 'fp8+fp8_kv'")
    return algo, kv
