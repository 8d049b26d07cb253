"""Optional dependencies: import them where they are used, or say which extra installs them."""

from __future__ import annotations

import importlib
from types import ModuleType

from exportlm.errors import MissingDependencyError

__all__ = ["require_modules"]


def require_modules(*modules: str, extra: str, purpose: str) -> list[ModuleType]:
    """Import ``modules`` and return them, in order.

    Raises:
        MissingDependencyError: one or more of them cannot be imported; the error
            names every missing one, ``purpose`` and ``pip install 'exportlm[extra]'``,
            and chains the first ``ImportError``.
    """
    loaded: list[ModuleType] = []
    missing: list[str] = []
    first_error: ImportError | None = None
    for name in modules:
        try:
            loaded.append(importlib.import_module(name))
        except ImportError as err:
            missing.append(name)
            first_error = first_error or err
    if missing:
        raise MissingDependencyError(missing, extra, purpose) from first_error
    return loaded
