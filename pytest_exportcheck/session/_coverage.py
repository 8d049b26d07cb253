"""Coverage as part of the verdict: which checks are *value* checks, and unchecked rows.

A target or module exporter whose value checks all skipped is *unchecked*, not
passed: the registration and dispatch checks can pass without anything it wrote
having been compared. :data:`VALUE_CHECKS` names them per scope, as data read
beside the catalogue (:mod:`pytest_exportcheck.checks.catalogue`); the JSON report
carries it, with the value-check items every row had planned (:func:`planned_value_items`)
and the rows their target declares it cannot check (:func:`declared_rows`), so
``exportlm report merge`` judges merged reports the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_exportcheck.plan import Discovery, ItemSpec

__all__ = [
    "VALUE_CHECKS",
    "declared_rows",
    "not_selected_lines",
    "planned_value_items",
    "strict_lines",
    "value_checks_json",
]

#: Per scope, the checks that compare what an export produced: logits through the
#: target's runtime, written tensors and configs, goldens, fake-quant parity.
VALUE_CHECKS: Mapping[str, frozenset[str]] = {
    "target": frozenset(
        {
            "roundtrip_logits",
            "dynamic_shapes",
            "cache_wrapper",
            "deterministic",
            "generation_parity",
            "roundtrip_generated",
            "checkpoint_names",
            "loadable",
            "roundtrip_quantized",
            "served",
        }
    ),
    "exporter": frozenset(
        {
            "export_contract",
            "moe_inputs",
            "tied_weights",
            "quantized_generated",
            "golden_checkpoint",
            "golden_calibration",
            "fp8_gemm",
        }
    ),
}


def value_checks_json() -> dict[str, list[str]]:
    """:data:`VALUE_CHECKS` as sorted lists (the JSON report's ``value_checks``)."""
    return {scope: sorted(checks) for scope, checks in VALUE_CHECKS.items()}


def planned_value_items(specs: Iterable[ItemSpec]) -> dict[str, dict[str, list[str]]]:
    """``{scope: {column: [item id]}}``: the value-check items of each row in ``specs``."""
    out: dict[str, dict[str, set[str]]] = {}
    for spec in specs:
        if spec.check in VALUE_CHECKS.get(spec.scope, ()):
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
