"""Coverage as part of the verdict: which checks are *value* checks, and unchecked rows.

A target or module exporter whose value checks all skipped is *unchecked*, not
passed: the registration and dispatch checks can pass without anything it wrote
having been compared. :data:`VALUE_CHECKS` names them per scope, as data read
beside the catalogue (:mod:`pytest_exportcheck.checks.catalogue`); the JSON report
carries it, so ``exportlm report merge`` judges merged reports the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from exportlm._matrix import unchecked_of

__all__ = ["VALUE_CHECKS", "strict_lines", "unchecked_rows", "value_checks_json"]

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


def unchecked_rows(
    items: Iterable[Mapping[str, Any]], judged: Iterable[tuple[str, str]] | None = None
) -> dict[str, list[str]]:
    """``{scope: [column]}`` of unchecked rows; with ``judged``, only those ``(scope, column)``."""
    rows = unchecked_of(items, VALUE_CHECKS)
    if judged is None:
        return rows
    keep = set(judged)
    out = {s: [c for c in cols if (s, c) in keep] for s, cols in rows.items()}
    return {s: cols for s, cols in out.items() if cols}


def strict_lines(rows: Mapping[str, list[str]]) -> list[str]:
    """The summary lines of a strict run that failed on ``rows`` (empty when none)."""
    named = [f"{scope} {column}" for scope, columns in rows.items() for column in columns]
    if not named:
        return []
    return [
        f"exportcheck --export-strict: FAILED, {len(named)} unchecked row(s) (no value "
        f"check passed or failed): {', '.join(named)}",
        "  give them a conformance model / the capability, accept a row with "
        "export_strict_allow (ROW reason), or run with --export-strict=off",
    ]
