"""What the module exporters do with the toy models: claims and recorded export calls.

Every selected toy model is quantized with every recipe of :data:`SURVEY_RECIPES`
that fits it, then exported with ``export_quantized_state`` through a *copy* of
the dispatch registry whose exporters are wrapped in recorders
(:mod:`._recording`). A recorder notes, for each ``export`` call, which exporter
ran on which module, the tensor names it wrote, whether the module's state
changed and what it raised. The global registry and the models' exporters are
never modified.

The survey is computed once per :class:`~._services.CheckServices` (the plugin
has one per process) for a given registry state, model selection and seed (the
exporter checks share it); the calibrated state of each quantized toy model is
shared across processes and runs through ``services.shared_dir``
(:mod:`._survey_store`), so one process calibrates it and the others read it back. Internal to
:mod:`pytest_exportcheck.checks` (a documented internal module: the exporter,
golden and generated checks read it through its public names).
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from exportlm.errors import UnsupportedFormatError
from exportlm.models import MODEL_REGISTRY, build_model, ensure_models_registered, model_names
from exportlm.module_exporters import (
    EXPORT_MODULE_REGISTRY,
    MODULE_EXPORTER_REGISTRY,
    ExporterEntry,
    ExportFormat,
    ExportModuleRegistry,
    ModuleExporter,
    QuantExportSummary,
    ensure_module_exporters_registered,
    export_quantized_state,
)
from exportlm.quant import is_quantized_module, quantize, synthetic_calibration
from pytest_exportcheck.checks._api import CheckResult, ExporterCase
from pytest_exportcheck.checks._common import CheckAbort, error_text
from pytest_exportcheck.checks._recording import ExportCall, Recorder, RecordingExporter
from pytest_exportcheck.checks._services import CheckServices
from pytest_exportcheck.checks._survey_store import (
    CalibratedState,
    StateStore,
    model_digest,
    source_digest,
)

__all__ = [
    "SCALE_LEAVES",
    "SURVEY_RECIPES",
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
    "tie_groups",
]

logger = logging.getLogger(__name__)

#: Recipes every toy model is quantized with (combinations that do not fit a model are skipped).
SURVEY_RECIPES = ("fp8", "nvfp4", "int4_awq", "int8_wo", "fp8+fp8_kv")
#: How a surveyed model is calibrated: ``"data"`` (a forward pass, as users do) or
#: ``"synthetic"`` (:func:`exportlm.quant.synthetic_calibration`: the same bytes on
#: every machine, for goldens).
Calibration = Literal["data", "synthetic"]
#: A recipe as the survey takes it: a string, or a mixed-precision mapping as
#: sorted ``(pattern, recipe)`` pairs (hashable, so surveys can be cached).
RecipeKey = str | tuple[tuple[str, str], ...]
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


def exporter_names() -> dict[int, str]:
    """``id(exporter) -> name`` for every named exporter (``MODULE_EXPORTER_REGISTRY``)."""
    ensure_module_exporters_registered()
    return {id(e.obj): e.name for e in MODULE_EXPORTER_REGISTRY.entries()}


def _name_of(exporter: ModuleExporter, names: Mapping[int, str]) -> str:
    return names.get(id(exporter), exporter.display_name)


def exporter_entry(case: ExporterCase) -> tuple[ModuleExporter, ExporterEntry, int]:
    """The exporter named ``case.name``, its dispatch entry and position; a failed result if absent."""
    ensure_module_exporters_registered()
    try:
        exporter = MODULE_EXPORTER_REGISTRY.get(case.name)
    except Exception as err:
        raise CheckAbort(
            CheckResult.failed(f"module exporter {case.name!r}: {error_text(err)}")
        ) from err
    for index, entry in enumerate(EXPORT_MODULE_REGISTRY.entries()):
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
    entries: Iterable[ExporterEntry] | None = None,
    wrap: Any = None,
) -> ExportModuleRegistry:
    """A new registry with ``entries`` (default: the global ones) in the same order.

    ``wrap(exporter) -> exporter`` replaces each exporter (e.g. by a recorder).
    """
    registry = type(EXPORT_MODULE_REGISTRY)()
    for entry in EXPORT_MODULE_REGISTRY.entries() if entries is None else entries:
        exporter = entry.exporter if wrap is None else wrap(entry.exporter)
        registry.register(exporter, *entry.keys, predicate=entry.predicate)
    return registry


def selected_models(case: ExporterCase) -> tuple[str, ...]:
    """The toy families of ``--export-models`` (``case.options["models"]``), else all."""
    available = model_names()
    raw = str(case.options.get("models", "all") or "all")
    if raw == "all":
        return tuple(available)
    wanted = [m.strip() for m in raw.split(",") if m.strip()]
    return tuple(m for m in wanted if m in available)


def _recording_registry(recorder: Recorder, names: Mapping[int, str]) -> ExportModuleRegistry:
    def wrap(exporter: ModuleExporter) -> ModuleExporter:
        cls = type(
            f"Recording_{type(exporter).__name__}_{id(exporter)}",
            (RecordingExporter,),
            {"exports_unquantized": bool(getattr(exporter, "exports_unquantized", False))},
        )
        wrapped: ModuleExporter = cls(exporter, _name_of(exporter, names), recorder)
        return wrapped

    return copy_registry(wrap=wrap)


# ----------------------------------------------------------------------------- the survey


def recipe_label(recipe: RecipeKey) -> str:
    """``fp8`` / ``fp8+fp8_kv`` as they are; a mixed recipe as ``*=fp8,*.mlp.*=nvfp4``."""
    if isinstance(recipe, str):
        return recipe
    return ",".join(f"{pattern}={value}" for pattern, value in recipe)


def _quantize(
    model_name: str,
    recipe: RecipeKey,
    seed: int,
    calibration: Calibration,
    device: str,
    services: CheckServices,
    *,
    wait: bool = True,
) -> nn.Module | str | None:
    """The quantized model (once per process), or why it could not be built.

    ``None`` only when ``wait`` is off and another process is calibrating it.
    Quantization does not depend on the exporter registry, so fakes registered
    by tests or plugins re-run only dispatch and export. A recorder restores a
    module an exporter modified, so a remembered model stays as quantized.
    """
    ensure_models_registered()
    factory = MODEL_REGISTRY.get(model_name)
    key = ("quantized", model_name, factory, recipe, seed, calibration, device)
    if services.known(key):
        return services.memo(key, _never)
    got = _quantize_afresh(model_name, recipe, seed, calibration, device, services, wait)
    return None if got is None else services.memo(key, lambda: got)


def _never() -> nn.Module | str:  # pragma: no cover - only called for a key that is known
    raise RuntimeError("a known memo key was computed again")


def _quantize_afresh(
    model_name: str,
    recipe: RecipeKey,
    seed: int,
    calibration: Calibration,
    device: str,
    services: CheckServices,
    wait: bool,
) -> nn.Module | str | None:
    plan = recipe if isinstance(recipe, str) else dict(recipe)
    try:
        model = build_model(model_name, seed=seed).to(device)  # seeded on the CPU, then moved
        if calibration == "synthetic":
            return quantize(model, plan, synthetic_calibration(seed))
        shared = services.shared_dir
        store = StateStore(None if shared is None else shared / "calibrated")
        if store.root is None:
            return quantize(model, plan)
        key = store.key(_material(model_name, model, recipe, seed, device, services))
        with store.lock(key, wait=wait) as held:
            if not held:
                return None
            state = store.read(key)
            restored = None if state is None else _restore(model_name, plan, seed, device, state)
            if restored is not None:
                return restored
            quantized = quantize(model, plan)
            store.write(key, CalibratedState.of(quantized))
            return quantized
    except UnsupportedFormatError as err:
        return f"{recipe_label(recipe)} does not fit {model_name}: {err}"
    except Exception as err:
        label = recipe_label(recipe)
        logger.warning("quantizing %s with %s failed: %s", model_name, label, err)
        return f"quantizing {model_name} with {label} raised {type(err).__name__}: {err}"


def _material(
    model_name: str,
    model: nn.Module,
    recipe: RecipeKey,
    seed: int,
    device: str,
    services: CheckServices,
) -> dict[str, Any]:
    """What a calibrated state depends on (the key of :class:`StateStore`)."""
    entry = MODEL_REGISTRY.get(model_name)
    family = str(getattr(getattr(entry, "factory", entry), "__module__", None) or "exportlm")
    packages = sorted({"exportlm", type(model).__module__.split(".")[0], family.split(".")[0]})
    return {
        "family": model_name,
        "recipe": recipe_label(recipe),
        "seed": seed,
        "device": device,
        "calibration": "data",
        "model": model_digest(model),
        "sources": [
            services.memo(("source", p), functools.partial(source_digest, p)) for p in packages
        ],
        "torch": torch.__version__,
    }


def _restore(
    model_name: str, plan: Any, seed: int, device: str, state: CalibratedState
) -> nn.Module | None:
    """The calibrated state loaded onto the structure (the recipe with synthetic
    statistics, no forward pass); ``None`` when it does not fit."""
    try:
        structure = quantize(
            build_model(model_name, seed=seed).to(device), plan, synthetic_calibration(seed)
        )
        return state.restore(structure)
    except Exception as err:
        logger.info("calibrated state of %s not restored, calibrating again: %s", model_name, err)
        return None


def survey_one(
    model_name: str,
    recipe: str,
    model: nn.Module,
    names: Mapping[int, str],
    format: ExportFormat = "modelopt",
) -> QuantizedModel:
    """Claims and recorded export of one quantized ``model`` (labelled ``model_name`` / ``recipe``).

    ``names`` is :func:`exporter_names`; an exception of the driver (or of an
    exporter) is kept in ``error`` / ``exception``, not raised.
    """
    result = QuantizedModel(model_name, recipe, model)
    for name, module in model.named_modules():
        exporter = EXPORT_MODULE_REGISTRY.match(module)
        quantized = is_quantized_module(module)
        if exporter is not None or quantized:
            label = None if exporter is None else _name_of(exporter, names)
            result.claims.append(Claim(model_name, recipe, name, module, quantized, label))
    recorder = Recorder(model_name, recipe)
    try:
        result.summary = export_quantized_state(
            model, recorder, format=format, registry=_recording_registry(recorder, names)
        )
    except Exception as err:
        result.error, result.exception = error_text(err), err
    result.calls, result.tensors = recorder.calls, recorder.tensors
    return result


def registry_state() -> tuple[Any, ...]:
    """The dispatch registry and the exporter names, as a memo key.

    It holds the exporters and predicates themselves (not their ``id()``), so a
    survey is never served to a registry whose objects merely reuse the addresses
    of collected ones.
    """
    ensure_module_exporters_registered()
    entries = tuple((e.exporter, e.keys, e.predicate) for e in EXPORT_MODULE_REGISTRY.entries())
    names = tuple(
        sorted(((e.name, e.obj) for e in MODULE_EXPORTER_REGISTRY.entries()), key=lambda p: p[0])
    )
    return entries + names


def _survey(
    models: tuple[str, ...],
    recipes: tuple[RecipeKey, ...],
    seed: int,
    calibration: Calibration,
    format: ExportFormat,
    device: str,
    services: CheckServices,
) -> Survey:
    names = exporter_names()
    built = _quantized_models(models, recipes, seed, calibration, device, services)
    quantized: list[QuantizedModel] = []
    skipped: dict[str, str] = {}
    for model_name in models:
        for recipe in recipes:
            model = built[(model_name, recipe)]
            label = recipe_label(recipe)
            if isinstance(model, str):
                skipped[f"{model_name}/{label}"] = model
                continue
            quantized.append(survey_one(model_name, label, model, names, format))
    return Survey(models, quantized, skipped)


def _quantized_models(
    models: tuple[str, ...],
    recipes: tuple[RecipeKey, ...],
    seed: int,
    calibration: Calibration,
    device: str,
    services: CheckServices,
) -> dict[tuple[str, RecipeKey], nn.Module | str]:
    """Every model x recipe quantized. A first pass skips what another process is
    calibrating (so two workers split the work), a second waits for it and reads it."""
    done: dict[tuple[str, RecipeKey], nn.Module | str] = {}
    for wait in (False, True):
        for pair in ((m, r) for m in models for r in recipes):
            if pair not in done:
                got = _quantize(*pair, seed, calibration, device, services, wait=wait)
                if got is not None:
                    done[pair] = got
    return done


def survey_of(
    models: tuple[str, ...],
    seed: int = 0,
    recipes: tuple[RecipeKey, ...] = SURVEY_RECIPES,
    *,
    calibration: Calibration = "data",
    format: ExportFormat = "modelopt",
    device: str = "cpu",
    services: CheckServices | None = None,
) -> Survey:
    """The survey of ``models`` x ``recipes`` with the current registry.

    ``calibration="synthetic"`` quantizes with machine-independent statistics
    (for goldens); ``format`` is the checkpoint layout the driver writes;
    ``device`` is where the models are quantized and exported (the weights are
    seeded on the CPU, then moved, so they are the same bits on every device).
    Computed once per ``services`` (a case's :class:`CheckServices`; default: a
    new one, nothing remembered) and registry state.
    """
    ensure_module_exporters_registered()
    ensure_models_registered()
    services = CheckServices() if services is None else services
    models, recipes = tuple(models), tuple(recipes)
    key = ("survey", models, recipes, seed, registry_state(), calibration, format, device)
    return services.memo(
        key, lambda: _survey(models, recipes, seed, calibration, format, device, services)
    )


def survey_for(case: ExporterCase) -> Survey:
    """The survey of the case's selected toy models (``--export-models``)."""
    return survey_of(selected_models(case), case.seed, services=case.services)


def tie_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter registered under more than one name (a tied group)."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        groups[id(param)].append(name)
    return [names for names in groups.values() if len(names) > 1]
