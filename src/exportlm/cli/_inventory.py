"""What is registered: targets, runtimes, module exporters, model families, serving
engines, quantization formats and their recipes, failed plugins.

Shared by ``exportlm list`` and ``exportlm env``; every list is plain JSON data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Inventory", "collect_inventory"]


@dataclass
class Inventory:
    """Every registry's entries, in the order ``exportlm list`` shows them."""

    targets: list[dict[str, Any]] = field(default_factory=list)
    runtimes: list[dict[str, str]] = field(default_factory=list)
    module_exporters: list[dict[str, str]] = field(default_factory=list)
    models: list[dict[str, str]] = field(default_factory=list)
    engines: list[dict[str, Any]] = field(default_factory=list)
    quant_formats: list[dict[str, Any]] = field(default_factory=list)
    recipes: list[dict[str, str]] = field(default_factory=list)
    failed_plugins: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of ``exportlm list --json``."""
        return {
            "targets": self.targets,
            "runtimes": self.runtimes,
            "module_exporters": self.module_exporters,
            "models": self.models,
            "engines": self.engines,
            "quant_formats": self.quant_formats,
            "recipes": self.recipes,
            "failed_plugins": self.failed_plugins,
        }


def collect_inventory() -> Inventory:
    """Load every registry (built-ins and entry points) and describe its entries."""
    from exportlm.export import (
        EXPORT_REGISTRY,
        RUNTIME_REGISTRY,
        ensure_exporters_registered,
        get_target_info,
    )
    from exportlm.inventory import plugin_inventory
    from exportlm.models import MODEL_REGISTRY, ensure_models_registered

    ensure_exporters_registered()
    ensure_models_registered()
    records = plugin_inventory()
    inventory = Inventory()
    for entry in EXPORT_REGISTRY.entries():
        info = get_target_info(entry.name)
        inventory.targets.append(
            {
                "name": entry.name,
                "provider": entry.provider,
                "runtime": info.runtime,
                "runtime_available": info.runtime in RUNTIME_REGISTRY,
                "artifact": info.artifact,
                "artifact_kind": info.artifact_kind,
                "scheme": info.scheme,
                "capabilities": sorted(info.capabilities),
                "atol": info.atol,
                "rtol": info.rtol,
                "variants": sorted(info.variants),
                "description": info.description,
            }
        )
    inventory.runtimes = [
        {"name": e.name, "provider": e.provider} for e in RUNTIME_REGISTRY.entries()
    ]
    inventory.models = [{"name": e.name, "provider": e.provider} for e in MODEL_REGISTRY.entries()]
    inventory.module_exporters = _module_exporters()
    inventory.engines = _engines()
    inventory.quant_formats, inventory.recipes = _quant()
    inventory.failed_plugins = [
        {
            "registry": r.kind,
            "name": r.name,
            "status": r.status,
            "distribution": r.provider,
            "entry_point": f"{r.group}: {r.name} = {r.value}",
            "error": r.message,
        }
        for r in records
        if r.status != "loaded"
    ]
    return inventory


def _module_exporters() -> list[dict[str, str]]:
    """The module exporters in match order (first match wins), with their match keys."""
    from exportlm import module_exporters

    module_exporters.ensure_module_exporters_registered()
    rows: list[dict[str, str]] = []
    for entry in module_exporters.EXPORT_MODULE_REGISTRY.entries():
        keys = ", ".join(k if isinstance(k, str) else k.__name__ for k in entry.keys)
        if entry.predicate is not None:
            keys = f"{keys} + predicate" if keys else "predicate"
        rows.append({"name": entry.name, "keys": keys, "provider": entry.provider})
    return rows


def _engines() -> list[dict[str, Any]]:
    """The serving engines: what their tables take and their stated tolerances."""
    from exportlm.engines import ENGINE_REGISTRY, ensure_engines_registered

    ensure_engines_registered()
    rows: list[dict[str, Any]] = []
    for entry in ENGINE_REGISTRY.entries():
        engine = entry.obj
        takes = sorted({r.target for r in engine.table})
        tolerances = [
            {"dtype": t.dtype, "scheme": t.scheme, "atol": t.atol, "evidence": t.evidence}
            for t in engine.tolerances
        ]
        rows.append(
            {
                "name": entry.name,
                "provider": entry.provider,
                "module": engine.module,
                "table_version": engine.table_version,
                "takes": takes,
                "tolerances": tolerances,
            }
        )
    return rows


def _quant() -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The quantization formats, and the recipes (weight and KV cache) on them."""
    from exportlm.quant import RECIPE_REGISTRY, Recipe, recipes
    from exportlm.quant._tensor import format_name
    from exportlm.quant.formats import QUANT_FORMATS

    formats = [{"name": e.name, "provider": e.provider} for e in QUANT_FORMATS.entries()]
    rows: list[dict[str, str]] = []
    for name, record in recipes().items():
        fmt = format_name(record.weight if isinstance(record, Recipe) else record.format)
        # a recipe a format still declares itself is provided by that format's provider
        owner = RECIPE_REGISTRY if name in RECIPE_REGISTRY else None
        provider = (owner.entry(name) if owner else QUANT_FORMATS.entry(fmt)).provider
        kind = "weights" if isinstance(record, Recipe) else "kv_cache"
        rows.append({"name": name, "format": fmt, "kind": kind, "provider": provider})
    return formats, rows
