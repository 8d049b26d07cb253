"""What is installed: targets (with variants), runtimes, module exporters, model families.

One :func:`discover` call loads every exportlm registry (built-ins and entry points)
and turns it into plain data the rest of the plugin works from, including the
plugins that failed to load. This is the only module of the plugin that knows the
registry APIs of ``exportlm.export``, ``exportlm.models`` and ``exportlm.module_exporters``
(the suite and ``parametrize_with_checks`` both plan from its record). Importing it
imports no exportlm: :func:`discover` does, and through it torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exportlm.export import TargetInfo

__all__ = ["Discovery", "InstalledPlugin", "PluginFailure", "TargetRow", "discover"]


@dataclass(frozen=True)
class InstalledPlugin:
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
    """Everything registered, sorted by name.

    ``model_failures`` holds, per loaded model family, the expected failures it
    declares (``{check id or item-id pattern: reason}``); ``model_causes`` its
    ``FailureCause`` records (crossed with each target's capture); ``model_since``
    the catalogue version that added it (``None``: not part of the catalogue).
    """

    targets: dict[str, TargetInfo] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    exporters: dict[str, Any] = field(default_factory=dict)
    plugins: tuple[InstalledPlugin, ...] = ()
    failures: tuple[PluginFailure, ...] = ()
    model_failures: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    model_causes: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    model_since: Mapping[str, int | None] = field(default_factory=dict)
    #: target -> the serving engines whose support table takes what it writes
    #: (``exportlm.engines.engines_taking``): the engine coordinate of ``served`` items.
    target_engines: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def golden_dirs(self) -> tuple[Path, ...]:
        """The ``goldens`` directories the registered exporters ship, by exporter name, deduplicated."""
        dirs: list[Path] = []
        for name in sorted(self.exporters):
            shipped = getattr(self.exporters[name], "goldens", None)
            if shipped is not None and Path(shipped) not in dirs:
                dirs.append(Path(shipped))
        return tuple(dirs)

    def rows(self, target: str) -> list[TargetRow]:
        """The matrix rows of ``target``: one per declared variant, else one."""
        info = self.targets[target]
        if not info.variants:
            return [TargetRow(target, None, {}, info)]
        return [TargetRow(target, v, dict(info.variants[v]), info) for v in sorted(info.variants)]


#: The inventory's registry kinds -> the plugin's row kinds.
_KINDS = {"export target": "target"}


def discover() -> Discovery:
    """Load every registry (idempotent) and describe what is there.

    Reads :func:`exportlm.inventory.plugin_inventory`, the one inventory that
    ``exportlm list`` and the ``plugin_loads`` check read too.
    """
    from exportlm.engines import engines_taking
    from exportlm.export import EXPORT_REGISTRY, get_target_info
    from exportlm.inventory import plugin_inventory
    from exportlm.models import (
        MODEL_REGISTRY,
        model_expected_failures,
        model_failure_causes,
        model_since,
    )
    from exportlm.module_exporters import EXPORT_MODULE_REGISTRY

    records = plugin_inventory()  # loads the registries; broken plugins are recorded
    plugins = tuple(
        InstalledPlugin(_KINDS.get(r.kind, r.kind), r.name, r.provider)
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
    models = tuple(MODEL_REGISTRY.names())
    targets = {name: get_target_info(name) for name in EXPORT_REGISTRY.names()}
    return Discovery(
        targets=targets,
        target_engines={
            n: tuple(engines_taking(i.artifact_kind, i.scheme)) if i.artifact_kind else ()
            for n, i in targets.items()
        },
        models=models,
        exporters={e.name: e.obj for e in EXPORT_MODULE_REGISTRY.entries()},
        plugins=plugins,
        failures=tuple(sorted(failures, key=lambda f: (f.kind, f.name, f.message))),
        model_failures={m: model_expected_failures(m) for m in models},
        model_causes={m: model_failure_causes(m) for m in models},
        model_since={m: model_since(m) for m in models},
    )
