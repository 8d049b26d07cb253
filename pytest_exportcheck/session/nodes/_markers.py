"""The markers of the suite's items, and their registration.

Every item carries ``exportcheck``, the markers its check declares
(``hypothesis`` for the Hypothesis-driven checks) and the warning filters of
:data:`EXPECTED_WARNINGS`. The plugin registers its markers in every run, so
``pytest --markers`` lists them and a ``--strict-markers`` host accepts them.
Imports only pytest.
"""

from __future__ import annotations

import pytest

__all__ = ["EXPECTED_WARNINGS", "MARKERS", "register_marker"]

#: The markers registered in every run, with their ``pytest --markers`` line.
MARKERS = {
    "exportcheck": "an item of the exportlm conformance suite (pytest --export-targets=..., "
    "or a test parametrized with pytest_exportcheck.parametrize_with_checks)",
    "hypothesis": "a test driven by Hypothesis (exportcheck: checks on generated structures)",
}

#: Warning filters of every item, applied after ``-W`` and ``filterwarnings``: a
#: deprecation that an export emits (torch's, exportlm's own) is shown in the
#: warnings summary but is not a conformance failure, even under ``-W error``.
EXPECTED_WARNINGS = (
    "default::DeprecationWarning",
    "default::PendingDeprecationWarning",
    "default::FutureWarning",
)


def register_marker(config: pytest.Config, name: str, description: str) -> None:
    """Register marker ``name`` unless it already is."""
    lines = config.getini("markers")
    known = {str(line).split(":", 1)[0].split("(", 1)[0].strip() for line in lines}
    if name not in known:
        config.addinivalue_line("markers", f"{name}: {description}")
