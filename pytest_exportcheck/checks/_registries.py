"""The registries a run reads, handed to the checks: ``case.services.registries``.

A :class:`Registries` holds the registry objects themselves (export targets,
runtimes, module exporters, toy model families, serving engines, quantization
formats), not copies, and answers every lookup a check or the run makes: a
target's record (:meth:`target_info`) and factory, its runtime loader, an export
and a load through them (:meth:`export`, :meth:`load`), the module-exporter
registry, a family's factory and model, an engine's record, the quantization recipes. Checks and the run
(``pytest_exportcheck/checks``, ``pytest_exportcheck/run``) read only this; none of
them imports an exportlm registry or its lookup functions (``tests/test_architecture.py``
holds that).

The one reader of the process's registries is :meth:`Registries.installed` (it
reads :func:`exportlm.inventory.registries`, so it loads the built-ins and entry
points as ``exportlm list`` does): the plugin's discovery builds the run's record
through it once, and a :class:`~pytest_exportcheck.checks._services.CheckServices`
built without one (a case a script makes itself) gets it on first use.

Importing this module imports no exportlm.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exportlm.engines import Engine
    from exportlm.export import RuntimeCallable, TargetInfo
    from exportlm.module_exporters import ExportModuleRegistry
    from exportlm.registry import PluginRecord, Registry

__all__ = ["Registries"]


@dataclass(frozen=True, eq=False)
class Registries:
    """The registries one run reads; see the module docstring.

    Attributes:
        targets: export targets (name -> factory), as ``EXPORT_REGISTRY``.
        runtimes: runtime loaders (name -> loader), as ``RUNTIME_REGISTRY``.
        module_exporters: the module-exporter dispatch registry, as ``EXPORT_MODULE_REGISTRY``.
        families: toy model families (name -> factory), as ``MODEL_REGISTRY``.
        engines: serving engines (name -> ``Engine``), as ``ENGINE_REGISTRY``.
        formats: quantization formats, as ``QUANT_FORMATS`` (inventoried only).
        recipes: quantization recipes, as ``RECIPE_REGISTRY`` (inventoried only).
    """

    targets: Registry[Any]
    runtimes: Registry[Any]
    module_exporters: ExportModuleRegistry
    families: Registry[Any]
    engines: Registry[Engine]
    formats: Registry[Any]
    recipes: Registry[Any] | None = None

    @classmethod
    def installed(cls) -> Registries:
        """The process's registries, loaded (built-ins and entry points; idempotent)."""
        from exportlm.inventory import registries

        targets, runtimes, exporters, families, engines, formats, recipes = registries()
        return cls(targets, runtimes, exporters, families, engines, formats, recipes)  # type: ignore[arg-type]

    # -- the inventory -----------------------------------------------------------
    def records(self) -> list[PluginRecord]:
        """Every registered entry and every failed or conflicting entry point, per registry
        (the order of :func:`exportlm.inventory.plugin_inventory`)."""
        every = (
            self.targets,
            self.runtimes,
            self.module_exporters,
            self.families,
            self.engines,
            self.formats,
            *([self.recipes] if self.recipes is not None else []),
        )
        return [record for registry in every for record in registry.records()]

    # -- targets and runtimes ------------------------------------------------------
    def target_names(self) -> list[str]:
        """Every registered target, sorted."""
        return self.targets.names()

    def target_factory(self, name: str) -> Any:
        """The export factory registered under ``name`` (``UnknownNameError`` if none)."""
        return self.targets.get(name)

    def target_info(self, name: str) -> TargetInfo:
        """The :class:`~exportlm.export.TargetInfo` of target ``name`` as registered."""
        from exportlm.export.targets import registered_info

        return registered_info(name, self.targets.get(name))

    def runtime_loader(self, name: str) -> Any:
        """The runtime loader of target ``name`` (through its declared ``runtime``)."""
        return self.runtimes.get(self.target_info(name).runtime)

    def export(self, name: str, model: Any, output: str | os.PathLike[str], **kwargs: Any) -> Path:
        """:func:`exportlm.export.export_model` with the target found here."""
        from exportlm.export import check_kwargs
        from exportlm.export.job import run_export

        factory = self.targets.get(name)
        check_kwargs(f"export target {name!r}", factory, kwargs)
        return run_export(self.target_info(name), factory, model, Path(output), kwargs)

    def load(
        self, name: str, path: str | os.PathLike[str], *, trust: bool = False, **kwargs: Any
    ) -> RuntimeCallable:
        """:func:`exportlm.export.load_exported` with the target and runtime found here."""
        from exportlm.export.targets import load_with

        info = self.target_info(name)
        return load_with(info, self.runtimes.get(info.runtime), path, trust=trust, **kwargs)

    # -- quantization recipes --------------------------------------------------------
    def recipe_records(self) -> dict[str, Any]:
        """Every quantization recipe by name, sorted: the records of :attr:`recipes` (built-in
        and ``exportlm.recipes`` entry points) and those the formats still declare, as
        :func:`exportlm.quant.recipes` lists them (``quantize`` reads the same)."""
        from exportlm.quant import recipes

        found = dict(recipes())
        if self.recipes is not None:
            found.update((entry.name, entry.obj) for entry in self.recipes.entries())
        return dict(sorted(found.items()))

    # -- toy model families --------------------------------------------------------
    def family_names(self) -> list[str]:
        """Every registered toy model family, sorted."""
        return self.families.names()

    def build_model(self, name: str, seed: int = 0, **overrides: Any) -> Any:
        """Family ``name`` built with ``seed`` (and config ``overrides``), as
        :func:`exportlm.models.build_model` builds it from its registry."""
        return self.families.get(name)(seed, **overrides)

    def tolerance_scale(self, name: str) -> float:
        """How much family ``name`` widens the targets' tolerances (1.0 unless it declares one)."""
        from exportlm.models import family_tolerance_scale

        return family_tolerance_scale(self.families.get(name)) if name in self.families else 1.0

    # -- serving engines -----------------------------------------------------------
    def engine(self, name: str) -> Engine:
        """The :class:`~exportlm.engines.Engine` record registered under ``name``."""
        return self.engines.get(name)

    def engines_taking(self, kind: str, scheme: str | None = None) -> list[str]:
        """The engines here whose support table takes artifacts of ``kind`` (and ``scheme``)."""
        from exportlm.engines import engines_taking

        records = [self.engines.get(n) for n in self.engines.names()]
        return engines_taking(kind, scheme, engines=records)
