"""What is registered: targets, runtimes, module exporters, model families, failed plugins.

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
    failed_plugins: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of ``exportlm list --json``."""
        return {
            "targets": self.targets,
            "runtimes": self.runtimes,
            "module_exporters": self.module_exporters,
            "models": self.models,
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
