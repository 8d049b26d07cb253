"""The catalogue version of a run and the items a pinned version leaves out (header, summary)."""

from __future__ import annotations

from typing import Any

from pytest_exportcheck.checks.versions import CATALOGUE_VERSION
from pytest_exportcheck.plan import Planner, PlanRequest

__all__ = ["catalogue_lines", "catalogue_record"]


def catalogue_record(planner: Planner, request: PlanRequest) -> dict[str, Any]:
    """``{"version", "current", "pinned", "newer_items": {version: count}}`` (JSON header)."""
    newer = planner.newer_items(request)
    return {
        "version": planner.catalogue or CATALOGUE_VERSION,
        "current": CATALOGUE_VERSION,
        "pinned": planner.catalogue is not None,
        "newer_items": {str(v): n for v, n in newer.items()},
    }


def catalogue_lines(record: dict[str, Any]) -> list[str]:
    """One line per newer version whose items a pinned run left out."""
    return [
        f"exportcheck catalogue v{record['version']}: {count} items new in v{version} not run: "
        f"pin exportcheck_catalogue = {version} to adopt"
        for version, count in record["newer_items"].items()
    ]
