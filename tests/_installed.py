"""Run pytester in-process against distributions "installed" in a directory.

The registries load entry points once per process (:func:`exportlm.registry.once`
and each registry's loaded groups). A run that installs a fake distribution
(:mod:`tests._distinfo`) therefore used to start a Python of its own, with the
directory on ``PYTHONPATH``: about 2.5 CPU seconds of imports each time.

:func:`installed` gives an in-process run what that fresh process would see: the
directory first on ``sys.path``, every registry holding its built-in entries only
with its entry-point groups not loaded, and the registration functions reset, so
the run's first ``ensure_*_registered()`` loads the entry points found then (and
warns about a broken one there, as a fresh process does); the check catalogue holds
the built-in checks only, so the run's conftest registers its own. On exit, the
registries get back exactly the entries, failures and loaded groups they had, and
the catalogue its checks; the run's modules under the session's base temporary
directory (the fake plugin) are dropped by pytester's ``sys.modules`` snapshot
(``tests/conftest.py``).

Each run gets a context of its own (:func:`runpytest_installed`): a run loads the
plugin as it is then (a module that reads an environment variable at import reads
it again). The directories also go first on ``PYTHONPATH``, for a process the run
starts, and in the ``sys.path`` xdist hands its workers: they do not read
``PYTHONPATH`` but get the ``sys.path`` the controller had when xdist was imported
(``xdist.plugin._sys_path``, a list its worker manager sends to each worker).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exportlm.engines import registry as engines
from exportlm.export import EXPORT_REGISTRY, RUNTIME_REGISTRY, ensure_exporters_registered
from exportlm.models import MODEL_REGISTRY, ensure_models_registered
from exportlm.module_exporters import EXPORT_MODULE_REGISTRY, ensure_module_exporters_registered
from exportlm.quant import RECIPE_REGISTRY
from exportlm.quant import _recipe_registry as recipes
from exportlm.quant.formats import QUANT_FORMATS
from exportlm.registry import Registry
from pytest_exportcheck.checks import _api as catalogue
from pytest_exportcheck.checks.catalogue import BUILTIN_CHECKS

__all__ = ["installed", "runpytest_installed"]

_REGISTRIES: tuple[Registry[Any], ...] = (
    EXPORT_REGISTRY,
    RUNTIME_REGISTRY,
    EXPORT_MODULE_REGISTRY,
    MODEL_REGISTRY,
    engines.ENGINE_REGISTRY,
    RECIPE_REGISTRY,
    QUANT_FORMATS,  # no entry points: a run's register_format is undone on exit
)
_GUARDS = (
    ensure_exporters_registered,
    ensure_module_exporters_registered,
    ensure_models_registered,
    engines._register,
    recipes._register,
)
#: A registry's state, what a fresh process starts without: every attribute a new
#: registry sets but its kind, validator and lock (so a field added later is kept too).
_STATE = tuple(n for n in vars(Registry("probe")) if n not in ("kind", "_validate", "_lock"))


def _save(registry: Registry[Any]) -> dict[str, Any]:
    return {name: copy.copy(getattr(registry, name)) for name in _STATE}


def _restore(registry: Registry[Any], state: dict[str, Any]) -> None:
    for name, value in state.items():
        setattr(registry, name, value)
    cache = getattr(registry, "_cache", None)  # the module exporters' dispatch memo
    if cache is not None:
        cache.clear()


def _builtins_only(registry: Registry[Any]) -> None:
    fresh = vars(Registry[Any](registry.kind))  # each field as a new registry has it
    builtins = {n: e for n, e in registry._entries.items() if e.builtin}
    _restore(registry, {name: fresh[name] for name in _STATE} | {"_entries": builtins})


def _worker_sys_path() -> list[str]:
    try:
        from xdist import plugin
    except ImportError:  # no xdist: no workers
        return []
    path: list[str] = plugin._sys_path
    return path


@contextlib.contextmanager
def _first_on_paths(entries: list[str]) -> Iterator[None]:
    """``entries`` first on ``sys.path``, xdist's worker path and ``PYTHONPATH``; then as before."""
    lists = [sys.path, _worker_sys_path()]
    before = [list(path) for path in lists]
    env = os.environ.get("PYTHONPATH")
    for path in lists:
        path[:0] = entries
    os.environ["PYTHONPATH"] = os.pathsep.join([*entries, *([env] if env else [])])
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for path, old in zip(lists, before, strict=True):
            path[:] = old
        if env is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = env
        importlib.invalidate_caches()


@contextlib.contextmanager
def installed(*paths: Path) -> Iterator[None]:
    """The registries as a fresh process with ``paths`` on its path would load them."""
    for guard in _GUARDS:
        guard()
    saved = [_save(registry) for registry in _REGISTRIES]
    checks = dict(catalogue._CHECKS)
    try:
        for registry in _REGISTRIES:
            _builtins_only(registry)
        for guard in _GUARDS:
            guard.reset()
        catalogue._CHECKS.clear()
        catalogue._CHECKS.update((spec.id, spec) for spec in BUILTIN_CHECKS)
        with _first_on_paths([str(p) for p in paths]):
            yield
    finally:
        for registry, state in zip(_REGISTRIES, saved, strict=True):
            _restore(registry, state)
        catalogue._CHECKS.clear()
        catalogue._CHECKS.update(checks)


def runpytest_installed(
    pytester: pytest.Pytester, paths: Path | list[Path], *args: Any
) -> pytest.RunResult:
    """``pytester.runpytest(*args)`` in this process, as if ``paths`` were installed."""
    with installed(*([paths] if isinstance(paths, Path) else paths)):
        return pytester.runpytest(*args)
