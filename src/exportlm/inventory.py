"""The plugin inventory: what every registry holds and which entry points failed.

One list of :class:`~exportlm.registry.PluginRecord` built from the registries
(export targets, runtimes, module exporters, model families, serving engines,
quantization formats, quantization recipes) after loading their entry points. It is the single source read by ``exportlm list``
and ``exportlm env``, by the pytest plugin's header and by its ``plugin_loads``
check, so they can never disagree about which plugin is broken.

Example::

    from exportlm.inventory import plugin_inventory

    for record in plugin_inventory():
        if record.status != "loaded":
            print(record.kind, record.name, record.provider, record.message)
"""

from __future__ import annotations

import warnings
from typing import Any

from exportlm.registry import PluginRecord, PluginWarning, Registry

__all__ = ["PluginRecord", "plugin_inventory", "registries"]


def registries() -> list[Registry[Any]]:
    """Every registry, loaded (built-ins and entry points; idempotent).

    Broken plugins do not raise here: they are recorded and appear in
    :func:`plugin_inventory` (and are warned about once with :class:`PluginWarning`
    by the registry loader, which this function silences: the inventory shows them).
    """
    from exportlm.engines.registry import ENGINE_REGISTRY, ensure_engines_registered
    from exportlm.export import EXPORT_REGISTRY, RUNTIME_REGISTRY, ensure_exporters_registered
    from exportlm.models import MODEL_REGISTRY, ensure_models_registered
    from exportlm.module_exporters import (
        EXPORT_MODULE_REGISTRY,
        ensure_module_exporters_registered,
    )
    from exportlm.quant import RECIPE_REGISTRY, ensure_recipes_registered
    from exportlm.quant.formats import QUANT_FORMATS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        ensure_exporters_registered()
        ensure_module_exporters_registered()
        ensure_models_registered()
        ensure_engines_registered()
        ensure_recipes_registered()
    module_registry: Registry[Any] = EXPORT_MODULE_REGISTRY
    engines: Registry[Any] = ENGINE_REGISTRY
    formats: Registry[Any] = QUANT_FORMATS
    recipes: Registry[Any] = RECIPE_REGISTRY
    return [
        EXPORT_REGISTRY,
        RUNTIME_REGISTRY,
        module_registry,
        MODEL_REGISTRY,
        engines,
        formats,
        recipes,
    ]


def plugin_inventory() -> list[PluginRecord]:
    """Every registered entry and every failed or conflicting entry point, per registry.

    Within a registry, entries come sorted by name, then the problems in the
    order they were found. ``status`` is ``"loaded"``, ``"failed"`` or
    ``"conflict"``; ``error`` carries the :class:`~exportlm.errors.PluginLoadError`
    or :class:`~exportlm.errors.RegistryConflictError`.
    """
    return [record for registry in registries() for record in registry.records()]
