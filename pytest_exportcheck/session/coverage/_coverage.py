"""Coverage as part of the verdict: which checks are *value* checks, and unchecked rows.

A target or module exporter whose value checks all skipped is *unchecked*, not
passed: the registration and dispatch checks can pass without anything it wrote
having been compared. Each check says whether it is one (``CheckSpec.value``, a
plugin's own check too); :func:`value_checks` gathers them per scope. The JSON report
carries them, with the value-check items every row had planned (:func:`planned_value_items`)
and the rows their target declares it cannot check (:func:`declared_rows`), so
``exportlm report merge`` judges merged reports the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from pytest_exportcheck.checks import CHECKS, CheckSpec
from pytest_exportcheck.checks.catalogue import SCOPES

if TYPE_CHECKING:
    from pytest_exportcheck.plan import Discovery, ItemSpec

__all__ = [
    "ValueChecks",
    "declared_rows",
    "not_selected_lines",
    "planned_value_items",
    "strict_lines",
    "value_checks",
    "value_checks_json",
]

#: ``{scope: value-check ids}``: the checks whose items decide whether a row was checked.
ValueChecks = Mapping[str, frozenset[str]]


def value_checks(checks: Iterable[CheckSpec] | None = None) -> ValueChecks:
    """Per scope, the ids of the checks that declare themselves value checks
    (:attr:`CheckSpec.value <pytest_exportcheck.checks.CheckSpec.value>`): those that
    compare what an export produced. ``checks`` defaults to every registered check
    (:data:`~pytest_exportcheck.checks.CHECKS`: the catalogue and the plugins' own)."""
    specs = CHECKS.values() if checks is None else checks
    found: dict[str, set[str]] = {scope: set() for scope in SCOPES}
    for spec in specs:
        if spec.value:
            found.setdefault(spec.scope, set()).add(spec.id)
    return {scope: frozenset(ids) for scope, ids in found.items()}


def value_checks_json(value: ValueChecks) -> dict[str, list[str]]:
    """``value`` as sorted lists (the JSON report's ``value_checks``)."""
    return {scope: sorted(checks) for scope, checks in value.items()}


def planned_value_items(
    specs: Iterable[ItemSpec], value: ValueChecks
) -> dict[str, dict[str, list[str]]]:
    """``{scope: {column: [item id]}}``: the value-check items of each row in ``specs``."""
    out: dict[str, dict[str, set[str]]] = {}
    for spec in specs:
        if spec.check in value.get(spec.scope, ()):
            out.setdefault(spec.scope, {}).setdefault(spec.column, set()).add(spec.name)
    return {s: {c: sorted(ids) for c, ids in sorted(r.items())} for s, r in sorted(out.items())}


def declared_rows(discovery: Discovery) -> dict[str, dict[str, str]]:
    """``{"target": {row: reason}}``: the rows whose target declares them not checkable
    on any toy family (``TargetInfo.unchecked``)."""
    rows: dict[str, str] = {}
    for name in sorted(discovery.targets):
        for row in discovery.rows(name):
            reason = row.info.unchecked.get(row.variant or "")
            if reason:
                rows[row.target_id] = reason
    return {"target": rows} if rows else {}


def not_selected_lines(rows: Mapping[str, list[str]]) -> list[str]:
    """The summary line naming the rows none of whose selected value checks checked."""
    named = [f"{scope} {column}" for scope, columns in rows.items() for column in columns]
    if not named:
        return []
    return [
        f"exportcheck: {len(named)} row(s) had no value check selected (-k, -m, "
        f"--export-checks), not judged by --export-strict: {', '.join(named)}"
    ]


def strict_lines(rows: Mapping[str, list[str]]) -> list[str]:
    """The summary lines of a strict run that failed on ``rows`` (empty when none)."""
    named = [f"{scope} {column}" for scope, columns in rows.items() for column in columns]
    if not named:
        return []
    return [
        f"exportcheck --export-strict: FAILED, {len(named)} unchecked row(s) (no value "
        f"check passed or failed): {', '.join(named)}",
        "  give them a conformance model / the capability, declare a row the target cannot "
        "check (export_target(unchecked={variant: reason})), accept a row with "
        "export_strict_allow (ROW reason), or run with --export-strict=off",
    ]
