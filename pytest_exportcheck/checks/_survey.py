"""What the module exporters do with the toy models: claims and recorded export calls.

Every selected toy model is quantized with every registered recipe that fits it
(:func:`survey_recipes`: the built-in ones, a plugin's, ``fp8+fp8_kv``; only
``--export-quantize``'s recipes when it names some), each in a
layout its formats have (``w8a8``, ``w4afp8``: compressed-tensors), then exported
with ``export_quantized_state`` through a *copy* of
the dispatch registry whose exporters are wrapped in recorders
(:mod:`._recording`). A recorder notes, for each ``export`` call, which exporter
ran on which module, the tensor names it wrote, whether the module's state
changed and what it raised. The registry of the case's services and the models' exporters are
never modified.

The survey is computed once per :class:`~._services.CheckServices` (the plugin
has one per process) for a given registry state, model selection and seed (the
exporter checks share it), and each toy model x recipe is quantized once per
services. Internal to :mod:`pytest_exportcheck.checks` (a documented internal
module: the exporter, golden and generated checks read it through its public names).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from exportlm.module_exporters import (
    ExporterEntry,
    ExportFormat,
    ExportModuleRegistry,
    ModuleExporter,
    QuantExportSummary,
    export_quantized_state,
)
from exportlm.quant import is_quantized_module
from pytest_exportcheck.checks._api import CheckResult, ExporterCase
from pytest_exportcheck.checks._common import CheckAbort, error_text
from pytest_exportcheck.checks._recipes import selected_recipes
from pytest_exportcheck.checks._recording import ExportCall, Recorder, RecordingExporter
from pytest_exportcheck.checks._services import CheckServices
from pytest_exportcheck.checks._survey_quantize import (
    Calibration,
    RecipeKey,
    quantized_models,
    recipe_label,
    survey_layout,
)

__all__ = [
    "SCALE_LEAVES",
    "Claim",
    "ExportCall",
    "QuantizedModel",
    "Survey",
    "Calibration",
    "RecipeKey",
    "copy_registry",
    "exporter_entry",
    "exporter_names",
    "recipe_label",
    "registry_state",
    "selected_models",
    "survey_for",
    "survey_of",
    "survey_one",
    "survey_recipes",
    "tie_groups",
]

logger = logging.getLogger(__name__)

#: Tensor-name leaves that are scales: never zero, never NaN/inf.
SCALE_LEAVES = ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale")


@dataclass(frozen=True)
class Claim:
    """A module of a quantized toy model and the exporter the registry dispatches it to."""

    model: str
    recipe: str
    name: str
    module: nn.Module
    quantized: bool
    exporter: str | None


@dataclass
class QuantizedModel:
    """One toy model x recipe: the quantized model, its claims, the export and its tensors."""

    model_name: str
    recipe: str
    model: nn.Module
    claims: list[Claim] = field(default_factory=list)
    calls: list[ExportCall] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    error: str | None = None
    summary: QuantExportSummary | None = None
    exception: BaseException | None = field(default=None, compare=False, repr=False)


@dataclass
class Survey:
    """Everything the exporter checks read (see the module docstring)."""

    models: tuple[str, ...]
    quantized: list[QuantizedModel]
    skipped: dict[str, str]

    def claims_of(self, exporter: str) -> list[Claim]:
        """Every module dispatched to ``exporter``."""
        return [c for q in self.quantized for c in q.claims if c.exporter == exporter]

    def calls_of(self, exporter: str) -> list[ExportCall]:
        """Every export call of ``exporter``."""
        return [c for q in self.quantized for c in q.calls if c.exporter == exporter]


def exporter_names(registry: ExportModuleRegistry) -> dict[int, str]:
    """``id(exporter) -> name`` for every named exporter of the dispatch ``registry``."""
    return {id(e.obj): e.name for e in registry.entries()}


def _name_of(exporter: ModuleExporter, names: Mapping[int, str]) -> str:
    return names.get(id(exporter), exporter.display_name)


def exporter_entry(case: ExporterCase) -> tuple[ModuleExporter, ExporterEntry, int]:
    """The exporter named ``case.name``, its dispatch entry and position; a failed result if absent."""
    registry = case.services.registries.module_exporters
    try:
        exporter = registry.get(case.name)
    except Exception as err:
        raise CheckAbort(
            CheckResult.failed(f"module exporter {case.name!r}: {error_text(err)}")
        ) from err
    for index, entry in enumerate(registry.entries()):
        if entry.exporter is exporter:
            return exporter, entry, index
    raise CheckAbort(
        CheckResult.failed(
            f"module exporter {case.name!r} is registered by name but has no entry in "
            "EXPORT_MODULE_REGISTRY, so it never claims a module; register it with "
            "EXPORT_MODULE_REGISTRY.register(exporter, *keys, predicate=...)"
        )
    )


def copy_registry(
    registry: ExportModuleRegistry,
    entries: Iterable[ExporterEntry] | None = None,
    wrap: Any = None,
) -> ExportModuleRegistry:
    """A new registry with ``entries`` (default: those of ``registry``) in the same order.

    ``wrap(exporter) -> exporter`` replaces each exporter (e.g. by a recorder).
    """
    copy = type(registry)()
    for entry in registry.entries() if entries is None else entries:
        exporter = entry.exporter if wrap is None else wrap(entry.exporter)
        copy.register(exporter, *entry.keys, predicate=entry.predicate)
    return copy


def selected_models(case: ExporterCase) -> tuple[str, ...]:
    """The toy families of ``--export-models`` (``case.options["models"]``), else all."""
    available = case.services.registries.family_names()
    raw = str(case.options.get("models", "all") or "all")
    if raw == "all":
        return tuple(available)
    wanted = [m.strip() for m in raw.split(",") if m.strip()]
    return tuple(m for m in wanted if m in available)


def _recording_registry(
    registry: ExportModuleRegistry, recorder: Recorder, names: Mapping[int, str]
) -> ExportModuleRegistry:
    def wrap(exporter: ModuleExporter) -> ModuleExporter:
        cls = type(
            f"Recording_{type(exporter).__name__}_{id(exporter)}",
            (RecordingExporter,),
            {"exports_unquantized": bool(getattr(exporter, "exports_unquantized", False))},
        )
        wrapped: ModuleExporter = cls(exporter, _name_of(exporter, names), recorder)
        return wrapped

    return copy_registry(registry, wrap=wrap)


# ----------------------------------------------------------------------------- the survey


def survey_one(
    model_name: str,
    recipe: str,
    model: nn.Module,
    names: Mapping[int, str],
    format: ExportFormat = "modelopt",
    *,
    registry: ExportModuleRegistry,
) -> QuantizedModel:
    """Claims and recorded export of one quantized ``model`` (labelled ``model_name`` / ``recipe``).

    ``registry`` is the dispatch registry, ``names`` its :func:`exporter_names`; an exception of the driver (or of an
    exporter) is kept in ``error`` / ``exception``, not raised.
    """
    result = QuantizedModel(model_name, recipe, model)
    for name, module in model.named_modules():
        exporter = registry.match(module)
        quantized = is_quantized_module(module)
        if exporter is not None or quantized:
            label = None if exporter is None else _name_of(exporter, names)
            result.claims.append(Claim(model_name, recipe, name, module, quantized, label))
    recorder = Recorder(model_name, recipe)
    try:
        result.summary = export_quantized_state(
            model, recorder, format=format, registry=_recording_registry(registry, recorder, names)
        )
    except Exception as err:
        result.error, result.exception = error_text(err), err
    result.calls, result.tensors = recorder.calls, recorder.tensors
    return result


def registry_state(registry: ExportModuleRegistry) -> tuple[Any, ...]:
    """The dispatch ``registry`` and the exporter names, as a memo key.

    It holds the exporters and predicates themselves (not their ``id()``), so a
    survey is never served to a registry whose objects merely reuse the addresses
    of collected ones.
    """
    entries = tuple((e.exporter, e.keys, e.predicate) for e in registry.entries())
    names = tuple(sorted(((e.name, e.obj) for e in registry.entries()), key=lambda p: p[0]))
    return entries + names


def survey_recipes(
    services: CheckServices, options: Mapping[str, Any] | None = None
) -> tuple[RecipeKey, ...]:
    """The recipes the survey quantizes with: ``--export-quantize``'s (a case's ``options``),
    else every registered one (:func:`~._recipes.selected_recipes` of ``services.registries``)."""
    return selected_recipes(options or {}, services.registries)


def _survey(
    models: tuple[str, ...],
    recipes: tuple[RecipeKey, ...],
    seed: int,
    calibration: Calibration,
    format: ExportFormat | None,
    device: str,
    services: CheckServices,
) -> Survey:
    registry = services.registries.module_exporters
    names = exporter_names(registry)
    built = quantized_models(models, recipes, seed, calibration, device, services, format)
    quantized: list[QuantizedModel] = []
    skipped: dict[str, str] = {}
    for model_name in models:
        for recipe in recipes:
            model = built[(model_name, recipe)]
            label = recipe_label(recipe)
            if isinstance(model, str):
                skipped[f"{model_name}/{label}"] = model
                continue
            layout = survey_layout(recipe, format)  # it quantized: a layout holds it
            quantized.append(survey_one(model_name, label, model, names, layout, registry=registry))
    return Survey(models, quantized, skipped)


def survey_of(
    models: tuple[str, ...],
    seed: int = 0,
    recipes: tuple[RecipeKey, ...] | None = None,
    *,
    calibration: Calibration = "data",
    format: ExportFormat | None = None,
    device: str = "cpu",
    services: CheckServices | None = None,
) -> Survey:
    """The survey of ``models`` x ``recipes`` with the dispatch registry of ``services``.

    ``recipes=None``: :func:`survey_recipes`. ``calibration="synthetic"`` quantizes with
    machine-independent statistics (for goldens); ``format`` is the checkpoint layout the
    driver writes (``None``: each recipe's own, quantized with its scale convention);
    ``device`` is where the models are quantized and exported (the weights are
    seeded on the CPU, then moved, so they are the same bits on every device).
    Computed once per ``services`` (a case's :class:`CheckServices`; default: a
    new one, nothing remembered) and registry state.
    """
    services = CheckServices() if services is None else services
    models = tuple(models)
    recipes = survey_recipes(services) if recipes is None else tuple(recipes)
    state = registry_state(services.registries.module_exporters)
    key = ("survey", models, recipes, seed, state, calibration, format, device)
    return services.memo(
        key, lambda: _survey(models, recipes, seed, calibration, format, device, services)
    )


def survey_for(case: ExporterCase) -> Survey:
    """The survey of the case's selected toy models (``--export-models``) with its recipes
    (``--export-quantize``'s, else every registered one: :func:`survey_recipes`)."""
    recipes = survey_recipes(case.services, case.options)
    return survey_of(selected_models(case), case.seed, recipes, services=case.services)


def tie_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter registered under more than one name (a tied group)."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        groups[id(param)].append(name)
    return [names for names in groups.values() if len(names) > 1]
