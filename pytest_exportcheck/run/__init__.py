"""Running items: the run package (one engine for the suite and ``parametrize_with_checks``).

:func:`run_item` runs one planned item with a :class:`RunServices` and returns its
result; the suite adds :class:`CachedExports` (the artifact cache and the memo of
failed exports) to its services. Imports the checks and exportlm, never the
pytest layer (``pytest_exportcheck.session``).
"""

from __future__ import annotations

from pytest_exportcheck.run._exports import CachedExports
from pytest_exportcheck.run._runner import (
    NO_CUDA,
    SEED,
    RunServices,
    build_case,
    check_services,
    run_item,
)

__all__ = [
    "NO_CUDA",
    "SEED",
    "CachedExports",
    "RunServices",
    "build_case",
    "check_services",
    "run_item",
]
