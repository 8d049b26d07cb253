"""What is installed: targets (with variants), runtimes, module exporters, model families.

One :func:`discover` call loads every exportlm registry (built-ins and entry points)
and turns it into plain data the rest of the plugin works from, including the
plugins that failed to load. This is the only module of the plugin that knows the
registry APIs of ``exportlm.export``, ``exportlm.models`` and ``exportlm.module_exporters``;
it is imported only once the suite is active (it imports torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from exportlm.export import EXPORT_REGISTRY, TargetInfo, get_target_info
from exportlm.inventory import plugin_inventory
from exportlm.models import MODEL_REGISTRY
from exportlm.module_exporters import EXPORT_MODULE_REGISTRY

__all__ = ["Discovery", "PluginFailure", "PluginRecord", "TargetRow", "discover"]


@dataclass(frozen=True)
class PluginRecord:
    """One registered object: its kind (``target``, ``runtime``, ...), name and provider."""

    kind: str
    name: str
    provider: str


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that failed to load, or claimed a name that was taken.

    ``kind`` is ``"target"``, ``"runtime"``, ``"module exporter"`` or ``"model family"``;
    ``name`` the entry-point name; ``distribution`` who shipped it; ``conflict`` is
    true for an entry point that claimed a taken name (the existing entry stays).
    """

    kind: str
    name: str
    distribution: str
    message: str
    conflict: bool = False


@dataclass(frozen=True)
class TargetRow:
    """One row of the target matrix: a target, or one variant of it."""

    target: str
    variant: str | None
    export_kwargs: Mapping[str, Any]
    info: TargetInfo

    @property
    def target_id(self) -> str:
        """``target`` or ``target:variant``."""
        return f"{self.target}:{self.variant}" if self.variant else self.target


@dataclass(frozen=True)
class Discovery:
    """Everything registered, sorted by name."""

    targets: dict[str, TargetInfo] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    exporters: dict[str, Any] = field(default_factory=dict)
    plugins: tuple[PluginRecord, ...] = ()
    failures: tuple[PluginFailure, ...] = ()

    def rows(self, target: str) -> list[TargetRow]:
        """The matrix rows of ``target``: one per declared variant, else one."""
        info = self.targets[target]
        if not info.variants:
            return [TargetRow(target, None, {}, info)]
        return [TargetRow(target, v, dict(info.variants[v]), info) for v in sorted(info.variants)]

    def failed_names(self, kind: str) -> list[str]:
        """Names of ``kind`` whose plugin failed to import (not name conflicts)."""
        return sorted({f.name for f in self.failures if f.kind == kind and not f.conflict})


#: The inventory's registry kinds -> the plugin's row kinds.
_KINDS = {"export target": "target"}


def discover() -> Discovery:
    """Load every registry (idempotent) and describe what is there.

    Reads :func:`exportlm.inventory.plugin_inventory`, the one inventory that
    ``exportlm list`` and the ``plugin_loads`` check read too.
    """
    records = plugin_inventory()  # loads the registries; broken plugins are recorded
    plugins = tuple(
        PluginRecord(_KINDS.get(r.kind, r.kind), r.name, r.provider)
        for r in records
        if r.status == "loaded"
    )
    failures = tuple(
        PluginFailure(
            _KINDS.get(r.kind, r.kind), r.name, r.provider, r.message, r.status == "conflict"
        )
        for r in records
        if r.status != "loaded"
    )
    return Discovery(
        targets={name: get_target_info(name) for name in EXPORT_REGISTRY.names()},
        models=tuple(MODEL_REGISTRY.names()),
        exporters={e.name: e.obj for e in EXPORT_MODULE_REGISTRY.entries()},
        plugins=plugins,
        failures=tuple(sorted(failures, key=lambda f: (f.kind, f.name, f.message))),
    )
