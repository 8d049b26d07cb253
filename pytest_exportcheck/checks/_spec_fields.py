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

__all__ = ["ARTIFACT_KINDS", "CatalogueError", "names", "resolve", "split_reference"]

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
