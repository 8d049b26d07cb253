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
from exportlm.module_exporters._default import (
    EXPORT_MODULE_REGISTRY,
    MODULE_EXPORTERS_GROUP,
    ensure_module_exporters_registered,
)
from exportlm.module_exporters._driver import checkpoint_bytes_at_least, export_quantized_state
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
    "checkpoint_bytes_at_least",
    "ensure_module_exporters_registered",
    "export_quantized_state",
    "library_dequantized_module",
    "qlora_saved_name",
    "register_builtin_module_exporters",
    "resolve_tied_weights",
    "validate_module_exporter",
]
