"""The default module-exporter registry and its loader (built-ins plus entry points).

Kept below both the package face and :mod:`._driver`, so that the driver finds
the default registry without importing the package that imports the driver.
"""

from __future__ import annotations

from exportlm.module_exporters._exporters import register_builtin_module_exporters
from exportlm.module_exporters._registry import ExportModuleRegistry
from exportlm.registry import load_entry_point_registry, once

__all__ = [
    "EXPORT_MODULE_REGISTRY",
    "MODULE_EXPORTERS_GROUP",
    "ensure_module_exporters_registered",
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
