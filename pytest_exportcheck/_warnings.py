"""The plugin's warning class, in a leaf so every layer can raise it without the package face."""

from __future__ import annotations

import pytest

__all__ = ["ExportCheckWarning"]


class ExportCheckWarning(pytest.PytestWarning):
    """An exportcheck configuration problem that does not stop the run.

    For example an expected-failure entry that matches no conformance item.
    """
