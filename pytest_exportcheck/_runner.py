"""Running one item: build its case, call its check, export through the artifact cache.

:class:`ItemRunner` is what every :class:`~pytest_exportcheck._nodes.ExportCheckItem`
hands off to. A failing :class:`~pytest_exportcheck.checks.CheckResult` becomes
:class:`~pytest_exportcheck._nodes.CheckFailed`, raised with the traceback of the
exception the code under test raised (when the check caught one), so ``--pdb``
starts in the frame that raised while the report shows the check's message.
Imported only once the suite is active (it imports exportlm and torch).
"""

from __future__ import annotations

import contextlib
import functools
import re
import shutil
import tempfile
import time
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest

from pytest_exportcheck._cache import ArtifactCache
from pytest_exportcheck._collect import ItemSpec
from pytest_exportcheck._discovery import Discovery
from pytest_exportcheck._failure_memo import ExportFailureMemo
from pytest_exportcheck._golden_setup import golden_store
from pytest_exportcheck._hypothesis import hypothesis_profile
from pytest_exportcheck._nodes import CheckFailed, ExportCheckItem
from pytest_exportcheck._options import Options
from pytest_exportcheck._report import jsonable
from pytest_exportcheck.checks import CHECKS, CheckResult, CheckSpec, ExporterCase, TargetCase
from pytest_exportcheck.checks._services import CheckServices

__all__ = ["SEED", "ItemRunner", "build_toy_model"]

#: Seed of every toy model the suite builds.
SEED = 0


def build_toy_model(name: str, seed: int) -> Any:
    """A toy model family from ``exportlm.models``, in eval mode."""
    from exportlm.models import build_model

    return build_model(name, seed=seed)


class ItemRunner:
    """Runs items of one pytest process; holds the artifact cache, the golden store and the
    services the checks share (:class:`~pytest_exportcheck.checks._services.CheckServices`)."""

    def __init__(self, config: pytest.Config, options: Options, discovery: Discovery) -> None:
        self.config = config
        self.options = options
        self.discovery = discovery
        self.scratch = _Scratch(config)
        self.services = CheckServices(build_toy_model)
        #: node id -> the time profile of the item that ran (``ItemProfile.as_json``).
        self.profiles: dict[str, dict[str, Any]] = {}
        self._accepts: dict[tuple[str, str], str | None] = {}

    def __call__(self, item: ExportCheckItem) -> None:
        """Run ``item`` and record its time profile (also when it skips or fails)."""
        profile = self.services.begin_item()
        start = time.perf_counter()
        try:
            self._run(item)
        finally:
            self.profiles[item.nodeid] = profile.as_json(time.perf_counter() - start)

    def _run(self, item: ExportCheckItem) -> None:
        """Check the item's device, build its case, call its check, record the result."""
        result = self._result(item)
        item.result = {
            "status": result.status,
            "message": result.message,
            "details": jsonable(dict(result.details)),
        }
        if result.status == "skip":
            pytest.skip(result.message or f"check {item.spec.check!r} skipped without a reason")
        if result.status == "fail":
            failure = CheckFailed(result)
            cause = result.exception
            if cause is None:
                raise failure
            # Carry the traceback of what the code under test raised: a post-mortem
            # debugger (--pdb) then starts in that frame, not in this one.
            raise failure.with_traceback(cause.__traceback__) from cause

    def _result(self, item: ExportCheckItem) -> CheckResult:
        spec = item.spec
        check = CHECKS.get(spec.check)
        if spec.failure is not None:  # a plugin_loads item of a plugin that failed to load
            return CheckResult.failed(spec.failure)
        if check is None:  # plugin_loads without a catalogue function: discovery said fine
            return CheckResult.passed(f"{spec.column} loaded")
        self._require_device(spec.device)
        case = self._case(item, check)
        with hypothesis_profile():
            result = check.fn(case)
        if not isinstance(result, CheckResult):
            raise TypeError(
                f"check {spec.check!r} returned {type(result).__name__}; "
                "a check must return a CheckResult"
            )
        return result

    def _require_device(self, device: str | None) -> None:
        if device != "cuda":
            return
        import torch

        if torch.cuda.is_available():
            return
        reason = "CUDA is not available on this machine (torch.cuda.is_available() is False)"
        if self.options.require_device:
            pytest.fail(f"{reason}, and --export-require-device is set", pytrace=False)
        pytest.skip(reason)

    def _case(self, item: ExportCheckItem, check: CheckSpec) -> TargetCase | ExporterCase:
        spec = item.spec
        # Read once the cache provider is configured (it is not yet in __init__).
        self.services.shared_dir = self.shared_dir
        common: dict[str, Any] = {
            "workdir": self.scratch.mktemp(spec.name),
            "seed": SEED,
            "goldens": self.goldens,
            "options": {**self.options.as_dict(), "expected_failure": _xfail_reason(item)},
            "services": self.services,
        }
        if check.scope == "exporter":
            if spec.exporter is None:  # pragma: no cover - plan() sets it
                raise RuntimeError(f"exporter item {spec.name} has no exporter")
            return ExporterCase(
                name=spec.exporter, device=spec.device or "cpu", model_name=spec.model, **common
            )
        if spec.target is None:  # pragma: no cover - plan() sets it
            raise RuntimeError(f"target item {spec.name} has no target")
        if spec.model is not None:
            self._require_accepted(spec.target, spec.model)
        export = functools.partial(self._export, spec)
        return TargetCase(
            target=spec.target,
            variant=spec.variant,
            export_kwargs=dict(spec.export_kwargs),
            model_name=spec.model,
            device=spec.device or "cpu",
            export=export,
            export_instance=export,
            **common,
        )

    def _require_accepted(self, target: str, model: str) -> None:
        accepts = self.discovery.targets[target].accepts
        if accepts is None:
            return
        if (target, model) not in self._accepts:
            self._accepts[(target, model)] = accepts(self.services.pristine_model(model, SEED))
        reason = self._accepts[(target, model)]
        if reason:
            pytest.skip(f"target {target!r} does not accept model {model!r}: {reason}")

    def _export(self, spec: ItemSpec, model: Any, **extra: Any) -> Path:
        """``TargetCase.export`` / ``export_instance``: the cached artifact for this target row.

        ``model`` is a toy family name or a model a check built itself.
        """
        if spec.target is None:  # pragma: no cover
            raise RuntimeError(f"item {spec.name} has no target to export with")
        info = self.discovery.targets[spec.target]
        cache, profile = self.cache, self.services.profile
        kwargs, device = {**spec.export_kwargs, **extra}, spec.device or "cpu"
        misses = cache.misses
        key = self._failure_key(spec.target, kwargs, model, device)
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
                    seed=SEED,
                    device=device,
                    suffix=info.suffix,
                    directory=info.artifact == "directory",
                )
            except Exception as err:
                if key is not None:
                    self.failures.remember(key, err)
                raise
            finally:
                exported = cache.misses > misses
                profile.count("cache_misses" if exported else "cache_hits")
                profile.count("exports", cache.misses - misses)
                phase.name = "export" if exported else "cache"

    def _failure_key(self, target: str, kwargs: Any, model: Any, device: str) -> str | None:
        """The artifact cache's key of this export, when failures are remembered across runs."""
        if self.failures.root is None:
            return None
        from exportlm.export import EXPORT_REGISTRY

        return self.cache.key(target, EXPORT_REGISTRY.get(target), kwargs, model, SEED, device)

    def _cache_dir(self, name: str) -> Path | None:
        """``<pytest cache>/exportcheck/<name>``; ``None`` under --export-no-cache or no cacheprovider."""
        cache = getattr(self.config, "cache", None)  # absent under -p no:cacheprovider
        if cache is None or self.options.no_cache:
            return None
        root = Path(cache.mkdir("exportcheck")) / name
        root.mkdir(parents=True, exist_ok=True)
        return root

    @cached_property
    def shared_dir(self) -> Path | None:
        """What the checks share across workers and runs (``CheckServices.shared_dir``)."""
        return self._cache_dir("shared")

    @cached_property
    def failures(self) -> ExportFailureMemo:
        """Exports whose exporter failed, remembered across runs under their cache key."""
        return ExportFailureMemo(self._cache_dir("failures"))

    @cached_property
    def cache(self) -> ArtifactCache:
        """Cross-run artifact cache (pytest cache dir) unless --export-no-cache or no cacheprovider."""
        root = self._cache_dir("artifacts")
        return ArtifactCache(
            self.scratch.mktemp("exportcheck-artifacts"), root, self.services.model
        )

    @cached_property
    def goldens(self) -> Any:
        """The golden store handed to every case."""
        return golden_store(self.config, self.options)

    def close(self) -> None:
        """Remove what this run created outside pytest's temporary directory, if anything."""
        self.scratch.close()


class _Scratch:
    """Empty directories for the cases and the in-session artifact cache.

    They come from the session's ``TempPathFactory`` (so ``--basetemp`` and the
    retention of ``tmp_path_retention_count`` / ``_policy`` apply), which pytest
    keeps as ``config._tmp_path_factory``. pytest has no public way for a plugin
    to reach it: only tests get it, through the ``tmp_path_factory`` fixture, and
    these items are not fixture-using functions (a ``pytest.Function`` named
    ``check[params]`` without a parametrization gets a node id that pytest 9 does
    not match with the one it reads back for --lf / --sw), and constructing one
    (``TempPathFactory.from_config``) is private too. pytest-xdist reads the same
    attribute. Without it (``-p no:tmpdir``) a temporary directory of our own is
    used and removed at the end of the run.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._own: Path | None = None

    def mktemp(self, name: str) -> Path:
        """A new empty directory named after ``name``."""
        base = re.sub(r"\W", "_", name)[:40]
        factory = getattr(self.config, "_tmp_path_factory", None)  # set by pytest_configure
        if isinstance(factory, pytest.TempPathFactory):
            return factory.mktemp(base, numbered=True)
        if self._own is None:
            self._own = Path(tempfile.mkdtemp(prefix="exportcheck-"))
        return Path(tempfile.mkdtemp(prefix=f"{base}-", dir=self._own))

    def close(self) -> None:
        """Remove the directory of our own, if one was made."""
        if self._own is not None:
            shutil.rmtree(self._own, ignore_errors=True)
            self._own = None


def _xfail_reason(item: pytest.Item) -> str | None:
    """The reason of the item's expected-failure mark, if it has one."""
    marker = item.get_closest_marker("xfail")
    return None if marker is None else str(marker.kwargs.get("reason", "expected failure"))
