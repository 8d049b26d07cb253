"""Per-module export of quantized models: context, exporters, registry and driver.

``export_quantized_state(model, sink)`` walks a model and dispatches each
quantized module to the first matching :class:`ModuleExporter` of
:data:`EXPORT_MODULE_REGISTRY` (DESIGN §4). Built-in exporters are registered
by :func:`register_builtin_module_exporters`, called from
:func:`ensure_module_exporters_registered`, which also loads third-party
exporters from the ``exportlm.module_exporters`` entry-point group.
"""

from __future__ import annotations

from typing import Any

from exportlm.modules._context import (
    EXPORT_FORMATS,
    DictSink,
    ExpertSlice,
    ExportContext,
    ExportFormat,
    QuantConfigCollector,
    QuantExportSummary,
    TensorSink,
)
from exportlm.modules._driver import export_quantized_state, resolve_tied_weights
from exportlm.modules._exporters import (
    BMMExpertsExporter,
    FusedExpertsExporter,
    IterableCatchAllExporter,
    IterableExpertsExporter,
    MoELinearExporter,
    QuantEmbeddingExporter,
    QuantLinearExporter,
    builtin_module_exporters,
    register_builtin_module_exporters,
)
from exportlm.modules._registry import (
    ExporterEntry,
    ExportModuleRegistry,
    MatchExplanation,
    MatchKey,
    ModuleExporter,
    ModulePredicate,
    exporter_attributes,
)
from exportlm.registry import Registry, load_entry_point_registry, once

__all__ = [
    "EXPORT_FORMATS",
    "EXPORT_MODULE_REGISTRY",
    "MODULE_EXPORTERS_GROUP",
    "MODULE_EXPORTER_REGISTRY",
    "BMMExpertsExporter",
    "DictSink",
    "ExpertSlice",
    "ExportContext",
    "ExportFormat",
    "ExportModuleRegistry",
    "ExporterEntry",
    "FusedExpertsExporter",
    "IterableCatchAllExporter",
    "IterableExpertsExporter",
    "MatchExplanation",
    "MatchKey",
    "MoELinearExporter",
    "ModuleExporter",
    "ModulePredicate",
    "QuantConfigCollector",
    "QuantEmbeddingExporter",
    "QuantExportSummary",
    "QuantLinearExporter",
    "TensorSink",
    "builtin_module_exporters",
    "ensure_module_exporters_registered",
    "export_quantized_state",
    "register_builtin_module_exporters",
    "resolve_tied_weights",
]

#: Entry-point group of third-party module exporters (public name, do not rename).
MODULE_EXPORTERS_GROUP = "exportlm.module_exporters"


def _validate_exporter(name: str, obj: Any) -> ModuleExporter:
    """Accept a ModuleExporter subclass (instantiated without arguments) or instance."""
    if isinstance(obj, type) and issubclass(obj, ModuleExporter):
        obj = obj()
    if not isinstance(obj, ModuleExporter):
        raise TypeError(
            f"module exporter {name!r} must be a ModuleExporter subclass or instance, "
            f"got {type(obj).__name__}"
        )
    keys, predicate, _ = exporter_attributes(obj)
    if not keys and predicate is None:
        raise TypeError(
            f"module exporter {name!r} ({type(obj).__name__}) declares no match keys and no "
            "predicate; set keys = ('MyQuantModule',) and/or a predicate on the class"
        )
    return obj


#: The dispatch registry used by :func:`export_quantized_state` (ordered, first match wins).
EXPORT_MODULE_REGISTRY = ExportModuleRegistry()
#: Module exporters by name (built-ins and entry points), for reports and the conformance suite.
MODULE_EXPORTER_REGISTRY: Registry[ModuleExporter] = Registry("module exporter", _validate_exporter)


@once
def ensure_module_exporters_registered() -> None:
    """Register the built-ins and load ``exportlm.module_exporters`` entry points (idempotent).

    Built-ins go into :data:`EXPORT_MODULE_REGISTRY` in their documented order and
    into :data:`MODULE_EXPORTER_REGISTRY` by name. An entry-point exporter is
    appended (or prepended when its class sets ``prepend = True``) with the keys
    and predicate it declares. A plugin that fails to load is recorded as a
    :class:`~exportlm.errors.PluginLoadError` (``MODULE_EXPORTER_REGISTRY.failed()``)
    and warned about; the others load.
    """
    for exporter in register_builtin_module_exporters(EXPORT_MODULE_REGISTRY):
        MODULE_EXPORTER_REGISTRY.register(exporter.display_name, exporter, builtin=True)
    for name in load_entry_point_registry(
        MODULE_EXPORTERS_GROUP, MODULE_EXPORTER_REGISTRY, raise_errors=False
    ):
        exporter = MODULE_EXPORTER_REGISTRY.get(name)
        keys, predicate, prepend = exporter_attributes(exporter)
        EXPORT_MODULE_REGISTRY.register(exporter, *keys, predicate=predicate, prepend=prepend)
