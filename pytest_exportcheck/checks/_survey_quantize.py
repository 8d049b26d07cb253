"""The survey's quantized toy models: built once per services.

Internal to :mod:`pytest_exportcheck.checks` (used by :mod:`._survey`). A model x
recipe is quantized once per :class:`~._services.CheckServices` (its memo, keyed
on the family's factory object, not its ``id()``).
"""

from __future__ import annotations

import logging
from typing import Any, Literal, cast

from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.module_exporters import ExportFormat
from exportlm.quant import quantize, synthetic_calibration
from exportlm.quant.formats import DEFAULT_LAYOUT
from pytest_exportcheck.checks._recipes import layout_recipe, recipe_layout
from pytest_exportcheck.checks._services import CheckServices

__all__ = ["Calibration", "RecipeKey", "quantized_models", "recipe_label", "survey_layout"]

logger = logging.getLogger(__name__)

#: How a surveyed model is calibrated: ``"data"`` (a forward pass, as users do) or
#: ``"synthetic"`` (:func:`exportlm.quant.synthetic_calibration`: the same bytes on
#: every machine, for goldens).
Calibration = Literal["data", "synthetic"]
#: A recipe as the survey takes it: a string, or a mixed-precision mapping as
#: sorted ``(pattern, recipe)`` pairs (hashable, so surveys can be remembered).
RecipeKey = str | tuple[tuple[str, str], ...]


def recipe_label(recipe: RecipeKey) -> str:
    """``fp8`` / ``fp8+fp8_kv`` as they are; a mixed recipe as ``*=fp8,*.mlp.*=nvfp4``."""
    if isinstance(recipe, str):
        return recipe
    return ",".join(f"{pattern}={value}" for pattern, value in recipe)


def survey_layout(recipe: RecipeKey, format: ExportFormat | None) -> ExportFormat:
    """The layout ``recipe`` is exported in: ``format``, else its own
    (:func:`~._recipes.recipe_layout`; a mixed recipe: the default layout).

    Raises:
        UnsupportedFormatError: ``format`` is ``None`` and no layout holds the recipe.
    """
    if format is not None:
        return format
    if not isinstance(recipe, str):
        return DEFAULT_LAYOUT
    return cast("ExportFormat", recipe_layout(recipe))


def _quantize(
    model_name: str,
    recipe: RecipeKey,
    seed: int,
    calibration: Calibration,
    device: str,
    services: CheckServices,
    format: ExportFormat | None = None,
) -> nn.Module | str:
    """The quantized model (once per services), or why it could not be built.

    ``format=None``: quantized for the recipe's own layout (:func:`survey_layout`, with
    that layout's scale convention); a layout named: quantized as the recipe says.
    Quantization does not depend on the exporter registry, so fakes registered
    by tests or plugins re-run only dispatch and export. A recorder restores a
    module an exporter modified, so a remembered model stays as quantized.
    """
    factory = services.registries.families.get(model_name)
    key = ("quantized", model_name, factory, recipe, seed, calibration, device, format)

    def build() -> nn.Module | str:
        try:
            if isinstance(recipe, str):
                plan: Any = layout_recipe(recipe, None if format else survey_layout(recipe, None))
            else:
                plan = dict(recipe)
            # A copy of the process's one build of the family (seeded on the CPU, then
            # moved): building a toy from its config costs ~0.3 s, copying it a few ms,
            # and the survey quantizes each family with every recipe.
            model = services.model(model_name, seed).to(device)
            if calibration == "synthetic":
                return quantize(model, plan, synthetic_calibration(seed))
            return quantize(model, plan)
        except UnsupportedFormatError as err:
            return f"{recipe_label(recipe)} does not fit {model_name}: {err}"
        except Exception as err:
            label = recipe_label(recipe)
            logger.warning("quantizing %s with %s failed: %s", model_name, label, err)
            return f"quantizing {model_name} with {label} raised {type(err).__name__}: {err}"

    return services.memo(key, build)


def quantized_models(
    models: tuple[str, ...],
    recipes: tuple[RecipeKey, ...],
    seed: int,
    calibration: Calibration,
    device: str,
    services: CheckServices,
    format: ExportFormat | None = None,
) -> dict[tuple[str, RecipeKey], nn.Module | str]:
    """Every model x recipe quantized (each once per services; ``format``: :func:`_quantize`)."""
    return {
        (m, r): _quantize(m, r, seed, calibration, device, services, format)
        for m in models
        for r in recipes
    }
