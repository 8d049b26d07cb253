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

from exportlm.errors import InvalidRecipeError, UnknownNameError, UnknownOptionError
from exportlm.quant._options import (
    OptionValue,
    apply_options,
    known_options,
    spell,
    split_options,
)
from exportlm.quant._recipe_registry import recipes
from exportlm.quant._recipes import DEFAULT_EXCLUDE, KVCacheRecipe, Recipe
from exportlm.quant._tensor import FormatId, format_name
from exportlm.quant.formats import CHECKPOINT_LAYOUTS

__all__ = [
    "ALGORITHMS",
    "DEFAULT_EXCLUDE",
    "KV_CACHE_FORMATS",
    "Algorithm",
    "QuantRecipe",
    "RecipeLike",
    "recipe_for_format",
    "recipe_names",
    "recipe_options",
    "recipes_for_format",
    "resolve_algorithm",
]

_V = TypeVar("_V")


#: The record of one weight recipe (the name the API had before recipes were records of
#: their own; :class:`~exportlm.quant.Recipe`).
Algorithm = Recipe


class _RecipeTable(Mapping[str, _V]):
    """A read-only ``{recipe name: value}`` view, rebuilt from the recipe registry."""

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


def _algorithms() -> dict[str, Recipe]:
    return {name: r for name, r in recipes().items() if isinstance(r, Recipe)}


def _kv_cache_formats() -> dict[str, FormatId]:
    return {name: r.format for name, r in recipes().items() if isinstance(r, KVCacheRecipe)}


#: Weight recipes by name, read from the recipe registry
#: (:mod:`exportlm.quant._recipes_builtin` lists the built-ins).
ALGORITHMS: Mapping[str, Recipe] = _RecipeTable(_algorithms)

#: KV-cache recipes: name -> format of the ``k_proj`` / ``v_proj`` output quantizers
#: (``fp8_kv`` -> fp8), read from the recipe registry.
KV_CACHE_FORMATS: Mapping[str, FormatId] = _RecipeTable(_kv_cache_formats)

RecipeLike = Any  # str | Sequence[str] | Mapping[str, str | None] | QuantRecipe


def resolve_algorithm(spelled: str) -> Recipe:
    """The :class:`~exportlm.quant.Recipe` of a recipe part as spelled, options applied (``"int4_awq:group_size=64"``).

    Raises :class:`~exportlm.errors.UnknownNameError` (unknown recipe),
    :class:`~exportlm.errors.UnknownOptionError` or
    :class:`~exportlm.errors.InvalidRecipeError` (see
    :func:`~exportlm.quant._options.apply_options`).
    """
    name, options = split_options(spelled)
    algo = recipes().get(name)
    if not isinstance(algo, Recipe):
        raise UnknownNameError("quantization recipe", name, recipe_names())
    return apply_options(algo, options) if options else algo


def recipe_names() -> list[str]:
    """Every recipe name accepted by :func:`~exportlm.quant.quantize`, sorted."""
    return list(recipes())


def recipe_for_format(fmt: FormatId) -> str:
    """The name of a weight recipe writing format ``fmt`` (the first by name), else the
    format's own name. One of several where the format has more (``int4``: ``int4_awq``,
    ``int4_gptq``): a message about a quantized model names the recipe its quantizer
    records (:attr:`TensorQuantizer.recipe <exportlm.quant.TensorQuantizer.recipe>`), or
    every recipe (:func:`recipes_for_format`), never this one alone."""
    mine = recipes_for_format(fmt)
    return mine[0] if mine else format_name(fmt)


def recipe_options(spelled: str) -> dict[str, str]:
    """``{option: the values it takes}`` of the recipe ``spelled`` (``"int4_awq:group_size=64"``
    or a name); :class:`~exportlm.errors.UnknownNameError` for an unknown recipe."""
    return known_options(resolve_algorithm(spelled))


def recipes_for_format(fmt: FormatId) -> list[str]:
    """The names of every weight recipe writing format ``fmt``, by name (empty: none)."""
    name = format_name(fmt)
    return sorted(r.name for r in _algorithms().values() if format_name(r.weight) == name)


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
            raise InvalidRecipeError(
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
            base = cls(algo=algo, kv_cache=kv, default_exclude=_default_exclude(algo))
        if options:
            base = base.with_options(options)
        if extra:
            return dataclasses.replace(base, exclude=base.exclude + extra)
        return base

    def with_options(self, options: Mapping[str, OptionValue]) -> QuantRecipe:
        """This recipe with ``options`` added to its default weight recipe's."""
        if self.algo is None:
            raise InvalidRecipeError(
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
        the calibrated model exactly (``docs/checkpoint-format.md``). A layout that
        quantizes only some modules (``gpt-oss-mxfp4``: the experts,
        :attr:`~exportlm.quant.formats.CheckpointLayout.quantized_modules`): the default
        weight recipe applies to those modules only (the overrides kept, after them). Other
        layouts: the recipe as it is. The CLI's ``export`` applies it from ``-o format=``.
        """
        holder = CHECKPOINT_LAYOUTS.get(layout)
        if holder is not None and holder.quantized_modules and self.algo is not None:
            only = tuple((pattern, self.algo) for pattern in holder.quantized_modules)
            return dataclasses.replace(self, algo=None, overrides=only + self.overrides)
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

    def algorithms(self) -> list[Recipe]:
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
                raise InvalidRecipeError(
                    f"recipe pattern {pattern!r}: KV-cache recipes ({sub_kv!r}) apply to the "
                    "whole model; put them under the '*' key, e.g. {'*': 'fp8+fp8_kv'}"
                )
            overrides.append((pattern, sub_algo))
        return cls(
            algo=algo,
            kv_cache=kv,
            overrides=tuple(overrides),
            default_exclude=_default_exclude(algo),
        )

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


def _default_exclude(algo: str | None) -> tuple[str, ...]:
    """The modules the default weight recipe ``algo`` leaves unquantized by default."""
    return DEFAULT_EXCLUDE if algo is None else resolve_algorithm(algo).default_exclude


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _split_parts(recipe: Any) -> tuple[str | None, str | None]:
    if isinstance(recipe, str):
        parts = [p.strip() for p in recipe.split("+")]
        if recipe.strip() and not all(parts):  # 'fp8+', 'fp8++fp8_kv': a part left out
            raise InvalidRecipeError(
                f"recipe {recipe!r} has an empty part; parts are recipe names joined by '+', "
                "e.g. 'fp8+fp8_kv'"
            )
        parts = [p for p in parts if p]
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
                raise InvalidRecipeError(
                    f"recipe {recipe!r} names two weight algorithms ({algo!r}, {spelled!r}); "
                    "use a mapping of module patterns for mixed precision"
                )
            algo = spelled
        else:
            raise UnknownNameError("quantization recipe", name, recipe_names())
    if not parts:
        raise InvalidRecipeError("empty quantization recipe; expected e.g. 'fp8' or 'fp8+fp8_kv'")
    return algo, kv
