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
    from pytest_exportcheck.checks._registries import Registries

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
    #: The registries this record was read from, handed to the checks and the run
    #: (``CheckServices.registries``); ``None``: a record built by hand.
    registries: Registries | None = field(default=None, compare=False, repr=False)

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


def discover(registries: Registries | None = None) -> Discovery:
    """Load every registry (idempotent) and describe what is there.

    ``registries``: the registries to describe (and hand to the run) instead of the
    process's; the toy families' declared failures are still read by name from the
    process's family registry.

    Reads the registries once (:meth:`Registries.installed`: the registries of
    :func:`exportlm.inventory.plugin_inventory`, the one inventory that ``exportlm list``
    and the ``plugin_loads`` check read too) and carries them for the checks and the run.
    """
    from exportlm.models import model_expected_failures, model_failure_causes, model_since
    from pytest_exportcheck.checks._registries import Registries

    if registries is None:  # loads the registries; broken plugins are recorded
        registries = Registries.installed()
    records = registries.records()
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
    models = tuple(registries.family_names())
    targets = {name: registries.target_info(name) for name in registries.target_names()}
    return Discovery(
        targets=targets,
        target_engines={
            n: tuple(registries.engines_taking(i.artifact_kind, i.scheme))
            if i.artifact_kind
            else ()
            for n, i in targets.items()
        },
        models=models,
        exporters={e.name: e.obj for e in registries.module_exporters.entries()},
        plugins=plugins,
        failures=tuple(sorted(failures, key=lambda f: (f.kind, f.name, f.message))),
        model_failures={m: model_expected_failures(m) for m in models},
        model_causes={m: model_failure_causes(m) for m in models},
        model_since={m: model_since(m) for m in models},
        registries=registries,
    )
