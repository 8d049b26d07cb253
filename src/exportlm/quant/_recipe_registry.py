"""The recipe registry: the built-in recipes plus the ``exportlm.recipes`` entry-point group.

``RECIPE_REGISTRY`` holds :class:`~exportlm.quant.Recipe` and
:class:`~exportlm.quant.KVCacheRecipe` records by name, registered in code
(:func:`register_recipe`) or through an entry point of :data:`RECIPES_GROUP` whose
value is a record. A format registered with the deprecated ``FormatSpec.recipe``
field (or a ``kv_cache`` scheme naming a KV-cache recipe) provides that recipe
too: :func:`recipes` reads them beside the registered ones, and a name is owned
by one of the two, never both.
"""

from __future__ import annotations

from typing import Any

from exportlm.errors import RegistryConflictError
from exportlm.quant._recipes import (
    KVCacheRecipe,
    Recipe,
    legacy_kv_recipe,
    legacy_recipe,
    recipe_problems,
)
from exportlm.quant._recipes_builtin import BUILTIN_RECIPES
from exportlm.quant.formats import formats
from exportlm.quant.formats._registry import install_recipe_claims
from exportlm.registry import Registry, load_entry_point_registry, once

__all__ = [
    "RECIPES_GROUP",
    "RECIPE_REGISTRY",
    "AnyRecipe",
    "ensure_recipes_registered",
    "recipes",
    "register_recipe",
    "validate_recipe",
]

#: The entry-point group third-party recipes register under (value: a :class:`Recipe`).
RECIPES_GROUP = "exportlm.recipes"

AnyRecipe = Recipe | KVCacheRecipe


def validate_recipe(name: str, obj: Any) -> AnyRecipe:
    """An entry point's object must be a sound :class:`Recipe` / :class:`KVCacheRecipe` of that name."""
    if not isinstance(obj, Recipe | KVCacheRecipe):
        raise TypeError(
            f"quantization recipe {name!r} must be an exportlm.quant.Recipe or KVCacheRecipe, "
            f"got {type(obj).__name__}"
        )
    if obj.name != name:
        raise ValueError(
            f"quantization recipe {name!r} points at a record named {obj.name!r}; "
            "the entry point's name and the record's name must be the same"
        )
    problems = list(recipe_problems(obj))
    if problems:
        raise ValueError(f"invalid quantization recipe {name!r}: " + "; ".join(problems))
    return obj


RECIPE_REGISTRY: Registry[AnyRecipe] = Registry("quantization recipe", validate_recipe)


def _legacy() -> dict[str, tuple[AnyRecipe, str]]:
    """``{name: (record, owner)}`` of the recipes registered formats still declare."""
    found: dict[str, tuple[AnyRecipe, str]] = {}
    for spec in formats():
        for record in (legacy_recipe(spec), legacy_kv_recipe(spec)):
            if record is not None and record.name not in RECIPE_REGISTRY:
                found[record.name] = (record, f"format {spec.name!r}")
    return found


def _registered_claims() -> dict[str, str]:
    """``{recipe name: owner}`` of the registered records (a format may not claim them)."""
    ensure_recipes_registered()
    return {
        entry.name: f"recipe {entry.name!r} ({entry.provider})"
        for entry in RECIPE_REGISTRY.entries()
    }


@once
def _register() -> None:
    for recipe in BUILTIN_RECIPES:
        RECIPE_REGISTRY.register(recipe.name, validate_recipe(recipe.name, recipe), builtin=True)
    load_entry_point_registry(RECIPES_GROUP, RECIPE_REGISTRY, raise_errors=False)


def ensure_recipes_registered() -> None:
    """Register the built-in recipes, then load third-party ones (idempotent).

    A third-party recipe that fails to load or validate is recorded
    (``RECIPE_REGISTRY.failed()``) and warned about; it never hides the others.
    """
    _register()


def register_recipe(recipe: AnyRecipe) -> AnyRecipe:
    """Add a recipe; returns it. After this, ``quantize(model, recipe.name)`` applies it,
    with the options its record takes (``"int4_rtn:group_size=64"``).

    Registering an equal record again is a no-op. Raises ``ValueError`` for an unsound
    record (its weight format unregistered, a ``group_size`` on a per-row format...)
    and :class:`~exportlm.errors.RegistryConflictError` for a name already taken.
    """
    ensure_recipes_registered()
    recipe = validate_recipe(getattr(recipe, "name", "?"), recipe)
    owner = _legacy().get(recipe.name)
    if owner is not None:
        raise RegistryConflictError(
            "quantization recipe", recipe.name, owner[1], f"recipe {recipe.name!r}"
        )
    return RECIPE_REGISTRY.register(recipe.name, recipe)


def recipes() -> dict[str, AnyRecipe]:
    """Every recipe by name, sorted: the registered records and the formats' own."""
    ensure_recipes_registered()
    found = {name: record for name, (record, _) in _legacy().items()}
    found.update((entry.name, entry.obj) for entry in RECIPE_REGISTRY.entries())
    return dict(sorted(found.items()))


install_recipe_claims(_registered_claims)
