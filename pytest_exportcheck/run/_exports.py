"""The suite's cached exports: ``TargetCase.export`` through the artifact cache and failure memo.

:class:`CachedExports` is what the suite's :class:`~pytest_exportcheck.run.RunServices`
carries (``parametrize_with_checks`` carries none: its checks export afresh). One
export of a (target row, model, seed, device) is shared by the checks of a process
and, through the cross-run cache directory, by later runs; an export that failed
is remembered under its cache key. The toy models come from the process's
:class:`~pytest_exportcheck.checks._services.CheckServices`, so the cache key and the
export use the model the runner's ``accepts`` call built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from pytest_exportcheck.checks._services import CheckServices
from pytest_exportcheck.plan import Discovery, ItemSpec
from pytest_exportcheck.run._cache import ArtifactCache
from pytest_exportcheck.run._failure_memo import ExportFailureMemo
from pytest_exportcheck.run._versions import Versions, factory_versions

__all__ = ["CachedExports"]


class CachedExports:
    """Exports of one process through the artifact cache.

    Args:
        discovery: the installed targets (suffix, artifact kind).
        services: the process's shared toy models and item profiles.
        session_dir: makes an empty scratch directory for in-session cache entries
            (called once, when the first export is asked for).
        cache_root: makes ``<pytest cache>/exportcheck``, or returns ``None`` (no
            cross-run cache); called once, when first needed.
        seed: the toy models' seed.
    """

    def __init__(
        self,
        discovery: Discovery,
        services: CheckServices,
        session_dir: Callable[[], Path],
        cache_root: Callable[[], Path | None],
        seed: int,
    ) -> None:
        self.discovery = discovery
        self.services = services
        self.session_dir = session_dir
        self.cache_root = cache_root
        self.seed = seed

    @cached_property
    def _root(self) -> Path | None:
        return self.cache_root()

    def _dir(self, name: str) -> Path | None:
        if self._root is None:
            return None
        root = self._root / name
        root.mkdir(parents=True, exist_ok=True)
        return root

    @cached_property
    def failures(self) -> ExportFailureMemo:
        """Exports whose exporter failed, remembered across runs under their cache key."""
        return ExportFailureMemo(self._dir("failures"))

    @cached_property
    def cache(self) -> ArtifactCache:
        """Cross-run artifact cache, or in-session only without a cache root."""
        return ArtifactCache(
            self.session_dir(),
            self._dir("artifacts"),
            self.services.model,
            self.services.registries,
        )

    def export(self, spec: ItemSpec, model: Any, **extra: Any) -> Path:
        """``TargetCase.export`` / ``export_instance``: the cached artifact for this target row.

        ``model`` is a toy family name or a model a check built itself.
        """
        if spec.target is None:  # pragma: no cover
            raise RuntimeError(f"item {spec.name} has no target to export with")
        info = self.discovery.targets[spec.target]
        cache, profile = self.cache, self.services.profile
        kwargs, device = {**spec.export_kwargs, **extra}, spec.device or "cpu"
        misses = cache.misses
        artifact_key = self._key(spec.target, kwargs, model, device)  # once per export
        key = artifact_key if self.failures.root is not None else None  # failures remembered
        exclusive = self.failures.exclusive(key) if key else contextlib.nullcontext()
        with self.services.phase("export") as phase, exclusive:
            remembered = None if key is None else self.failures.recall(key)
            if remembered is not None:
                phase.name = "cache"
                profile.count("cache_hits")
                raise remembered
            try:
                return cache.export(
                    spec.target,
                    kwargs,
                    model,
                    seed=self.seed,
                    device=device,
                    suffix=info.suffix,
                    directory=info.artifact == "directory",
                    key=artifact_key,
                )
            except Exception as err:
                if key is not None:
                    self.failures.remember(key, err, self._versions(spec.target))
                raise
            finally:
                exported = cache.misses > misses
                profile.count("cache_misses" if exported else "cache_hits")
                profile.count("exports", cache.misses - misses)
                phase.name = "export" if exported else "cache"

    def _key(self, target: str, kwargs: Any, model: Any, device: str) -> str:
        """The artifact cache's key of this export (also the failure memo's)."""
        factory = self.services.registries.target_factory(target)
        return self.cache.key(target, factory, kwargs, model, self.seed, device)

    def _versions(self, target: str) -> Versions:
        """The library versions in the cache key of ``target``'s exports (the same computation)."""
        return factory_versions(self.services.registries.target_factory(target))
