"""What is installed: targets (with variants), runtimes, module exporters, model families.

One :func:`discover` call loads every exportlm registry (built-ins and entry points)
and turns it into plain data the rest of the plugin works from, including the
plugins that failed to load. This is the only module of the plugin that knows the
registry APIs of ``exportlm.export``, ``exportlm.models`` and ``exportlm.modules``;
it is imported only once the suite is active (it imports torch).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from exportlm.errors import PluginLoadError, RegistryConflictError
from exportlm.export import (
    EXPORT_REGISTRY,
    RUNTIME_REGISTRY,
    TargetInfo,
    ensure_exporters_registered,
    get_target_info,
)
from exportlm.registry import PluginWarning, Registry

__all__ = ["Discovery", "PluginFailure", "PluginRecord", "TargetRow", "discover"]

logger = logging.getLogger(__name__)


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


def discover() -> Discovery:
    """Load every registry (idempotent) and describe what is there."""
    with warnings.catch_warnings():
        # Broken plugins become failing plugin_loads items; no duplicate warning.
        warnings.simplefilter("ignore", PluginWarning)
        ensure_exporters_registered()
        models_registry = _models_registry()
        exporters_registry = _exporters_registry()
    registries: list[tuple[str, Registry[Any]]] = [
        ("target", EXPORT_REGISTRY),
        ("runtime", RUNTIME_REGISTRY),
    ]
    if exporters_registry is not None:
        registries.append(("module exporter", exporters_registry))
    if models_registry is not None:
        registries.append(("model family", models_registry))
    plugins = tuple(
        PluginRecord(kind, entry.name, entry.provider)
        for kind, registry in registries
        for entry in registry.entries()
    )
    failures = tuple(f for kind, registry in registries for f in _failures(kind, registry))
    return Discovery(
        targets={name: get_target_info(name) for name in EXPORT_REGISTRY.names()},
        models=tuple(models_registry.names()) if models_registry is not None else (),
        exporters=(
            {e.name: e.obj for e in exporters_registry.entries()}
            if exporters_registry is not None
            else {}
        ),
        plugins=plugins,
        failures=tuple(sorted(failures, key=lambda f: (f.kind, f.name, f.message))),
    )


def _failures(kind: str, registry: Registry[Any]) -> list[PluginFailure]:
    out: list[PluginFailure] = []
    failed_by_error = {id(err): name for name, err in registry.failed().items()}
    for err in registry.plugin_errors:
        if isinstance(err, RegistryConflictError):
            out.append(PluginFailure(kind, err.name, err.new_owner, str(err), conflict=True))
        elif isinstance(err, PluginLoadError):
            name = failed_by_error.get(id(err)) or err.entry_point.split("=", 1)[0].strip()
            out.append(PluginFailure(kind, name, err.distribution, str(err)))
        else:  # pragma: no cover - the registry records only the two kinds above
            out.append(PluginFailure(kind, "?", "<unknown distribution>", str(err)))
    return out


def _models_registry() -> Registry[Any] | None:
    try:
        from exportlm.models import MODEL_REGISTRY, ensure_models_registered
    except ImportError as err:  # pragma: no cover - partial install
        logger.warning("exportlm.models is unavailable (%s): no model families", err)
        return None
    ensure_models_registered()
    return MODEL_REGISTRY


def _exporters_registry() -> Registry[Any] | None:
    try:
        from exportlm.modules import (
            MODULE_EXPORTER_REGISTRY,
            ensure_module_exporters_registered,
        )
    except ImportError as err:
        logger.warning("exportlm.modules is unavailable (%s): no module exporters", err)
        return None
    ensure_module_exporters_registered()
    registry: Registry[Any] = MODULE_EXPORTER_REGISTRY
    return registry
