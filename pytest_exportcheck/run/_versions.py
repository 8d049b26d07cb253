"""The library versions an export depends on: one computation for the cache key and the memo.

An export is a function of its inputs and of the code that runs it: the target's own
package (hashed by :func:`pytest_exportcheck.run._cache.source_digest`) and every
library that package calls into. :func:`export_versions` names those libraries with
their installed versions:

* Python and the libraries every artifact depends on (:data:`VERSIONED`: exportlm,
  torch, transformers, onnx, onnxruntime, onnxscript), whichever target exports;
* the installed distribution that provides the target's module, and every
  distribution it requires, transitively (its ``Requires-Dist`` whose markers hold
  here, extras requested by a requirement included). A backend the
  target declares (a compiler, an engine's exporter) is in the list with its version,
  so upgrading it changes the key: a cached artifact is rebuilt and a remembered
  failure is not replayed.

A target defined outside any installed distribution (a ``conftest.py``) has only its
own source and the libraries above in its key. Everything is read from installed
metadata (``importlib.metadata``) without importing anything, once per process.
"""

from __future__ import annotations

import importlib.metadata
import sys
from functools import cache

from exportlm._libraries import EXPORT_LIBRARIES

__all__ = [
    "VERSIONED",
    "Versions",
    "describe_versions",
    "export_versions",
    "factory_versions",
    "library_versions",
]

#: The libraries every artifact depends on, whichever target exports (the library's one list).
VERSIONED = EXPORT_LIBRARIES

#: ``(distribution, version or None when not installed)``, in a stable order.
Versions = tuple[tuple[str, str | None], ...]


def version_of(dist: str) -> str | None:
    """The installed version of distribution ``dist``; ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@cache
def library_versions() -> Versions:
    """Versions of Python and of the libraries every artifact depends on."""
    python = ".".join(map(str, sys.version_info[:3]))
    return (("python", python), *((d, version_of(d)) for d in VERSIONED))


@cache
def _distributions_of(top: str) -> tuple[str, ...]:
    return tuple(importlib.metadata.packages_distributions().get(top, ()))


@cache
def export_versions(module_name: str) -> Versions:
    """The versions an export by the target defined in ``module_name`` depends on.

    The target's distribution and what it requires directly first (the names a
    message shows), then :func:`library_versions`, then the indirect requirements;
    each name once.
    """
    found: dict[str, str | None] = {}
    depth: dict[str, int] = {}
    for dist in _distributions_of(module_name.split(".", 1)[0]):
        _walk(dist, found, depth)
    ordered = {name: found[name] for name in found if depth[name] <= 1}
    for name, version in (*library_versions(), *found.items()):
        ordered.setdefault(name, version)
    return tuple(ordered.items())


def _walk(root: str, found: dict[str, str | None], depth: dict[str, int]) -> None:
    """Add ``root`` and what it requires here, transitively, breadth first, to ``found``."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    pending: list[tuple[str, tuple[str, ...], int]] = [(root, (), 0)]
    while pending:
        name, extras, level = pending.pop(0)
        canonical = canonicalize_name(name)
        if canonical in found:
            continue
        depth[canonical] = level
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            found[canonical] = None
            continue
        found[canonical] = dist.version
        for line in dist.requires or ():
            try:
                requirement = Requirement(line)
            except InvalidRequirement:
                continue
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in ("", *extras)):
                pending.append((requirement.name, tuple(sorted(requirement.extras)), level + 1))


def factory_versions(factory: object) -> Versions:
    """:func:`export_versions` of the module that defines a target's ``factory``."""
    return export_versions(getattr(factory, "__module__", None) or "?")


def describe_versions(versions: Versions, limit: int = 8) -> str:
    """``"a 1.0, b 2.1, ... and N more"``: the first ``limit`` of ``versions``, readable."""
    shown = [f"{name} {version or '(not installed)'}" for name, version in versions[:limit]]
    more = len(versions) - limit
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")
