"""Per-module export of quantized models: context, exporters, registry and driver.

``export_quantized_state(model, sink)`` walks a model and dispatches each
quantized module to the first matching :class:`ModuleExporter` of
:data:`EXPORT_MODULE_REGISTRY`, the one module-exporter registry:
its entries carry their names, match keys and predicates, in dispatch order.
Built-in exporters are registered by :func:`register_builtin_module_exporters`,
called from :func:`ensure_module_exporters_registered`, which also loads
third-party exporters from the ``exportlm.module_exporters`` entry-point group.

This package depends on :mod:`exportlm.quant` only: never on the toy models
(:mod:`exportlm.models`) or the export targets (:mod:`exportlm.export`).
"""

from __future__ import annotations

from exportlm.module_exporters._base import MatchKey, ModuleExporter, ModulePredicate
from exportlm.module_exporters._conformance import (
    ConformanceModel,
    DequantizedLinear,
    library_dequantized_module,
)
from exportlm.module_exporters._context import (
    EXPORT_FORMATS,
    DictSink,
    ExpertSlice,
    ExportContext,
    ExportFormat,
    LayerFacts,
    QuantConfigCollector,
    QuantExportSummary,
    TensorSink,
    qlora_saved_name,
)
from exportlm.module_exporters._driver import export_quantized_state
from exportlm.module_exporters._experts import DbrxExpertsExporter
from exportlm.module_exporters._exporters import (
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
from exportlm.module_exporters._registry import (
    ExporterEntry,
    ExportModuleRegistry,
    MatchExplanation,
    validate_module_exporter,
)
from exportlm.module_exporters._ties import TieBook, resolve_tied_weights
from exportlm.registry import load_entry_point_registry, once

__all__ = [
    "EXPORT_FORMATS",
    "EXPORT_MODULE_REGISTRY",
    "MODULE_EXPORTERS_GROUP",
    "BMMExpertsExporter",
    "ConformanceModel",
    "DbrxExpertsExporter",
    "DequantizedLinear",
    "DictSink",
    "ExpertSlice",
    "ExportContext",
    "ExportFormat",
    "ExportModuleRegistry",
    "ExporterEntry",
    "FusedExpertsExporter",
    "IterableCatchAllExporter",
    "IterableExpertsExporter",
    "LayerFacts",
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
    "TieBook",
    "builtin_module_exporters",
    "ensure_module_exporters_registered",
    "export_quantized_state",
    "library_dequantized_module",
    "qlora_saved_name",
    "register_builtin_module_exporters",
    "resolve_tied_weights",
    "validate_module_exporter",
]

#: Entry-point group of third-party module exporters (public name, do not rename).
MODULE_EXPORTERS_GROUP = "exportlm.module_exporters"

#: The module-exporter registry: named entries in dispatch order (first match wins),
#: used by :func:`export_quantized_state`, reports and the conformance suite.
EXPORT_MODULE_REGISTRY = ExportModuleRegistry()


@once
def ensure_module_exporters_registered() -> None:
    """Register the built-ins and load ``exportlm.module_exporters`` entry points (idempotent).

    Built-ins go into :data:`EXPORT_MODULE_REGISTRY` in their documented order.
    An entry-point exporter (a :class:`ModuleExporter` subclass or instance) is
    registered under its entry-point name with the keys and predicate it
    declares, appended (or prepended when its class sets ``prepend = True``). A
    plugin that fails to load, or claims a taken name, is recorded
    (``EXPORT_MODULE_REGISTRY.failed()``, ``.plugin_errors``) and warned about;
    the others load.
    """
    register_builtin_module_exporters(EXPORT_MODULE_REGISTRY)
    load_entry_point_registry(MODULE_EXPORTERS_GROUP, EXPORT_MODULE_REGISTRY, raise_errors=False)
