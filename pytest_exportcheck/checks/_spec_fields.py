"""The field rules of a :class:`~pytest_exportcheck.checks.catalogue.CheckSpec`: stdlib only.

How a spec's name sets are normalized and how its ``"module:function"``
implementation reference is split and imported on first use. Kept apart from the
catalogue's data so the catalogue stays the list of checks; importing this module
imports nothing of the package.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "ARTIFACT_KINDS",
    "CatalogueError",
    "check_fields",
    "names",
    "resolve",
    "split_reference",
]

#: The artifact kinds a check may declare it reads (``TargetInfo.artifact``).
ARTIFACT_KINDS = frozenset({"file", "directory"})


class CatalogueError(ValueError):
    """A check declaration is invalid, duplicated, or disagrees with the catalogue."""


def names(check_id: str, what: str, value: Iterable[str]) -> frozenset[str]:
    """``value`` as a frozenset of names; a bare string is refused (it would be its letters)."""
    if isinstance(value, str):
        raise CatalogueError(
            f"check {check_id!r}: {what} must be a collection of names, not the string {value!r}"
        )
    return frozenset(value)


def check_fields(spec: Any, scopes: tuple[str, ...]) -> None:
    """Refuse a spec whose id, scope and scope-bound fields do not go together."""
    if not spec.artifacts <= ARTIFACT_KINDS:
        raise CatalogueError(
            f"check {spec.id!r}: artifacts {sorted(spec.artifacts)} are not among "
            f"{sorted(ARTIFACT_KINDS)}"
        )
    if not isinstance(spec.cost, int) or spec.cost < 1:
        raise CatalogueError(
            f"check {spec.id!r}: cost must be a whole number >= 1, not {spec.cost!r}"
        )
    if not spec.id.isidentifier():
        raise CatalogueError(
            f"check id {spec.id!r} is not a Python identifier; ids appear in item ids "
            "and --export-checks, so use lowercase words joined by '_'"
        )
    if spec.scope not in scopes:
        raise CatalogueError(
            f"check {spec.id!r}: scope {spec.scope!r} is not one of {list(scopes)}"
        )
    if spec.per_model and spec.scope != "target":
        raise CatalogueError(f"check {spec.id!r}: per_model=True needs scope='target'")
    if spec.per_engine and not spec.per_model:
        raise CatalogueError(f"check {spec.id!r}: per_engine=True needs per_model=True")
    if spec.per_device and spec.scope != "exporter":
        raise CatalogueError(
            f"check {spec.id!r}: per_device=True is for scope='exporter' "
            "(target checks always run on every --export-device)"
        )
    if spec.models and not spec.per_model:
        raise CatalogueError(f"check {spec.id!r}: models=... needs per_model=True")
    if (spec.devices and spec.scope != "exporter") or (spec.artifacts and spec.scope != "target"):
        raise CatalogueError(
            f"check {spec.id!r}: devices=... is for scope='exporter', artifacts=... for "
            "scope='target' (a target declares its devices through the 'cuda' capability)"
        )


def split_reference(check_id: str, reference: str) -> tuple[str, str]:
    """``"package.module:function"`` -> ``(module, function)``."""
    module, sep, name = reference.partition(":")
    if not sep or not module or not name.isidentifier():
        raise CatalogueError(
            f"check {check_id!r}: implementation reference {reference!r} is not of the "
            "form 'package.module:function'"
        )
    return module, name


@functools.cache
def resolve(check_id: str, reference: str) -> Callable[[Any], Any]:
    """The function ``reference`` names, importing its module (once)."""
    module_name, name = split_reference(check_id, reference)
    module = importlib.import_module(module_name)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise CatalogueError(
            f"check {check_id!r}: {module_name} has no function {name!r} "
            f"(the catalogue's reference is {reference!r})"
        )
    resolved: Callable[[Any], Any] = fn
    return resolved
