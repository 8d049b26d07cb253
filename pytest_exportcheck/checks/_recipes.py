"""The recipes the quantized checks use: every registered recipe, each in a layout it has.

:func:`conformance_recipes` reads the recipe registry of the case's services
(:meth:`~._registries.Registries.recipe_records`: the built-in records, the
``exportlm.recipes`` entry points and :func:`exportlm.quant.register_recipe`'s), so a
recipe a plugin adds is checked like a built-in one with no change here. Each weight
recipe is used alone; each KV-cache recipe is combined with the weight recipe of its
own format (``fp8_kv`` with ``fp8``: ``fp8+fp8_kv``).

:func:`recipe_layout` is the checkpoint layout a recipe is written in: the default one
(ModelOpt) when its formats have a scheme there, else the first layout that holds them
(``w8a8``, ``w4afp8``: compressed-tensors), read off the formats by
:func:`exportlm.quant.check_layout`, the CLI's own refusal. :func:`layout_recipe` is
the recipe with that layout's scale convention (``QuantRecipe.for_layout``), as
``exportlm export -o format=...`` quantizes it.

Internal to :mod:`pytest_exportcheck.checks` (the quantized target check, ``loadable``
and the exporter survey read it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from exportlm.errors import UnsupportedFormatError
from exportlm.quant import KVCacheRecipe, QuantFormat, QuantRecipe, Recipe, check_layout
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, DEFAULT_LAYOUT

if TYPE_CHECKING:
    from pytest_exportcheck.checks._registries import Registries

__all__ = ["conformance_recipes", "layout_recipe", "recipe_layout", "selected_recipes"]


def conformance_recipes(registries: Registries) -> tuple[str, ...]:
    """Every registered weight recipe (sorted), then each KV-cache recipe combined with a
    weight recipe of its format (``fp8+fp8_kv``; the first weight recipe when none is)."""
    records = registries.recipe_records()
    weights = {name: r for name, r in records.items() if isinstance(r, Recipe)}
    combined: list[str] = []
    for name, record in records.items():
        if not isinstance(record, KVCacheRecipe) or not weights:
            continue
        kv_format = _format_name(record.format)
        same = [n for n, r in weights.items() if _format_name(r.weight) == kv_format]
        combined.append(f"{(same or list(weights))[0]}+{name}")
    return (*weights, *combined)


def selected_recipes(options: Mapping[str, Any], registries: Registries) -> tuple[str, ...]:
    """``--export-quantize``'s recipes (a case's ``options["quantize"]``), else every
    registered one (:func:`conformance_recipes`): what ``roundtrip_quantized``, the exporter
    survey and ``quantized_generated`` quantize with."""
    chosen = tuple(options.get("quantize") or ())
    return chosen or conformance_recipes(registries)


def _format_name(fmt: QuantFormat | str) -> str:
    return fmt.value if isinstance(fmt, QuantFormat) else str(fmt)


def recipe_layout(recipe: str) -> str:
    """The checkpoint layout ``recipe`` is written in (see the module docstring).

    Raises:
        UnsupportedFormatError: no layout holds it, with each layout's refusal.
    """
    parsed = QuantRecipe.parse(recipe)
    order = [DEFAULT_LAYOUT, *(name for name in CHECKPOINT_LAYOUTS if name != DEFAULT_LAYOUT)]
    refusals: list[str] = []
    for layout in order:
        try:
            check_layout(parsed, layout)
        except UnsupportedFormatError as err:
            refusals.append(str(err))
            continue
        return layout
    raise UnsupportedFormatError(
        f"no checkpoint layout holds recipe {recipe!r}: " + "; ".join(refusals)
    )


def layout_recipe(recipe: str, layout: str | None) -> QuantRecipe:
    """``recipe`` as quantized for ``layout`` (its scale convention); ``None``: as it is."""
    parsed = QuantRecipe.parse(recipe)
    return parsed if layout is None else parsed.for_layout(layout)
