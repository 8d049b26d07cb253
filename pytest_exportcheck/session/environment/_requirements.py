"""What the conformance suite needs installed, checked when it is requested.

The plugin itself imports only pytest; the suite needs torch and Hypothesis. A
missing one is a usage error naming the module and the install command, raised
in ``pytest_configure`` before anything imports it, instead of an INTERNALERROR
from deep inside discovery.
"""

from __future__ import annotations

import importlib

import pytest

__all__ = ["INSTALL_HINT", "SUITE_MODULES", "require_suite_modules"]

#: Modules the suite imports, beyond exportlm itself.
SUITE_MODULES = ("torch", "hypothesis")
#: The install command that brings them.
INSTALL_HINT = "pip install 'exportlm[pytest]'"


def require_suite_modules(modules: tuple[str, ...] = SUITE_MODULES) -> None:
    """Import each of ``modules``; the first that fails is a :class:`pytest.UsageError`."""
    for name in modules:
        try:
            importlib.import_module(name)
        except (ImportError, OSError) as err:  # OSError: a torch whose native libraries are missing
            raise pytest.UsageError(
                f"exportcheck: the conformance suite (--export-* options) needs the module "
                f"{name!r}, which cannot be imported ({type(err).__name__}: {err}). "
                f"Install the suite's dependencies: {INSTALL_HINT}"
            ) from err
