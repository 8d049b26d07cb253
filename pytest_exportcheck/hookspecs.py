"""Hooks that conftest files and other pytest plugins can implement to extend exportcheck.

Registered by ``pytest_addhooks`` in :mod:`pytest_exportcheck.plugin`, in the style of
pytest-xdist's ``newhooks.py``. Implement them in a ``conftest.py`` or a pytest plugin::

    def pytest_exportcheck_report(config, report):
        upload_to_dashboard(report["matrix"])

This module imports nothing but pytest.
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["pytest_exportcheck_report"]


@pytest.hookspec
def pytest_exportcheck_report(config: pytest.Config, report: dict[str, Any]) -> None:
    """Called once, on the controller, with the conformance report after the run.

    ``report`` is the same JSON-compatible mapping ``--export-report`` writes
    (options, environment, plugins, matrix, items); use it to upload results to
    a dashboard or to gate on a custom rule. Not called on xdist workers.
    """
