"""The conformance matrix and JSON report, built from test reports on the controller.

Every report of an exportcheck item carries a JSON-compatible mapping in its
``exportcheck`` attribute (:data:`REPORT_ATTRIBUTE`): ``{"item": coordinates,
"result": status, message and details or None}``. pytest serializes a report's
attributes when xdist sends it from a worker to the controller, so
:class:`ReportBuilder.add`, fed from ``pytest_runtest_logreport``, sees the same
records with or without xdist. Imports only pytest and the standard library.
"""

from __future__ import annotations

import json
import math
import numbers
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from exportlm._matrix import (
    INCOMPLETE,
    NOT_APPLICABLE,
    OUTCOMES,
    REPORT_FORMAT,
    Coverage,
    Rows,
    coverage_of,
    matrix_lines,
    matrix_of,
    render_matrix,
    totals_of,
)
from exportlm._report_html import report_badge, report_html
from exportlm.atomic import write_text_atomic
from pytest_exportcheck.session.coverage._coverage import (
    ValueChecks,
    value_checks,
    value_checks_json,
)

__all__ = [
    "OUTCOMES",
    "REPORT_ATTRIBUTE",
    "ItemRecord",
    "ReportBuilder",
    "jsonable",
    "render_matrix",
    "write_json_atomic",
    "write_report_pages",
]

#: The attribute of a ``TestReport`` holding an exportcheck item's record.
REPORT_ATTRIBUTE = "exportcheck"
_SKIP_PREFIX = "Skipped: "


def jsonable(value: Any) -> Any:
    """``value`` with numbers as float/int, non-finite floats as strings, the rest as str."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else str(number)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [jsonable(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    item = getattr(value, "item", None)  # 0-d tensors and numpy scalars
    if callable(item):
        try:
            return jsonable(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


@dataclass
class ItemRecord:
    """One exportcheck item as seen by the controller."""

    id: str
    nodeid: str
    check: str
    scope: str
    column: str
    check_index: int = 0
    model: str | None = None
    device: str | None = None
    #: ``incomplete`` until the item finishes (its call, or a skip or failure, and its teardown).
    outcome: str = INCOMPLETE
    duration: float = 0.0
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    #: Where the item's time went (``CheckServices`` profile): seconds per phase, cache use.
    profile: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The JSON record (``check_index``: the check's catalogue position, the row order)."""
        data = asdict(self)
        data["duration"] = round(self.duration, 4)
        return data


class ReportBuilder:
    """Accumulates :class:`ItemRecord` from test reports and renders the matrix.

    ``planned`` (``{scope: {column: [value-check item id]}}`` of every check) tells a
    row narrowed by ``-k`` / ``--export-checks`` from an unchecked one, ``declared``
    (``{scope: {column: reason}}``) the rows their target declares it cannot check;
    ``judged`` (a shard's whole rows) limits the coverage lines to those rows;
    ``not_applicable`` lists the (row, check) cells the plan has no item of, with the
    reason (``·`` in the matrix, the report's ``not_applicable``); ``value`` the value
    checks per scope (default: every registered check's own ``value``).
    """

    def __init__(
        self,
        planned: Rows | None = None,
        declared: Rows | None = None,
        judged: set[tuple[str, str]] | None = None,
        not_applicable: list[dict[str, Any]] | None = None,
        value: ValueChecks | None = None,
    ) -> None:
        self.records: dict[str, ItemRecord] = {}
        self.value = value_checks() if value is None else value
        self.planned = planned or {}
        self.declared = declared or {}
        self.judged = judged
        self.not_applicable = not_applicable or []
        #: Set when the run was interrupted (Ctrl-C, SIGINT): its unfinished items fail.
        self.interrupted = False
        self._called: set[str] = set()

    def add(self, report: pytest.TestReport) -> None:
        """Fold one phase report (setup, call or teardown) of an exportcheck item in."""
        data = getattr(report, REPORT_ATTRIBUTE, None)
        if not isinstance(data, dict) or not isinstance(data.get("item"), dict):
            return
        meta = data["item"]
        record = self.records.get(report.nodeid)
        if record is None:
            record = ItemRecord(
                id=str(meta["id"]),
                nodeid=report.nodeid,
                check=str(meta["check"]),
                scope=str(meta["scope"]),
                column=str(meta["column"]),
                check_index=int(meta.get("check_index", 0)),
                model=meta.get("model"),
                device=meta.get("device"),
            )
            self.records[report.nodeid] = record
        record.duration += report.duration
        result = data.get("result") if report.when == "call" else None
        if isinstance(result, dict):
            record.message = str(result.get("message", ""))
            record.details = dict(result.get("details", {}))
        profile = data.get("profile") if report.when == "call" else None
        if isinstance(profile, dict):
            record.profile = dict(profile)
        if report.when == "call" and report.passed:
            self._called.add(report.nodeid)
        _fold_outcome(
            record,
            report,
            check_failed=isinstance(result, dict) and result.get("status") == "fail",
            called=report.nodeid in self._called,
        )

    def matrix(self) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
        """``{scope: {column: {check: {outcome: count}}}}``, sorted."""
        return matrix_of(self._plain())

    def totals(self) -> dict[str, int]:
        """Item counts per outcome."""
        return totals_of(self._plain())

    def coverage(self) -> Coverage:
        """The rows that checked nothing: unchecked, declared so, not selected."""
        return coverage_of(
            self._plain(),
            self.value,
            self.planned,
            self.declared,
            judged=self.judged,
            not_applicable=self.not_applicable,
        )

    def unchecked(self) -> dict[str, list[str]]:
        """``{scope: [column]}``: the rows whose value checks all skipped (or xfailed)."""
        return self.coverage().unchecked

    def _plain(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.records.values()]

    def skip_reasons(self) -> list[tuple[str, int]]:
        """Distinct skip reasons with their counts, most frequent first."""
        counts = Counter(r.message for r in self.records.values() if r.outcome == "skip")
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))

    def cache_use(self) -> dict[str, int]:
        """Items whose artifacts all came from the cache, items that exported, and exports."""
        profiles = [r.profile for r in self.records.values()]
        return {
            "served_from_cache": sum(p.get("artifact") == "cached" for p in profiles),
            "exported": sum(p.get("artifact") == "exported" for p in profiles),
            "exports": sum(int(p.get("exports", 0)) for p in profiles),
        }

    def slowest(self, n: int) -> list[ItemRecord]:
        """The ``n`` items that took longest (setup, call and teardown together)."""
        ranked = sorted(self.records.values(), key=lambda r: (-r.duration, r.nodeid))
        return ranked[: max(0, n)]

    def to_json(self, **header: Any) -> dict[str, Any]:
        """The JSON report: ``header`` fields, matrix, totals, coverage, per-item records."""
        coverage = self.coverage()
        return {
            "format": REPORT_FORMAT,
            **header,
            "interrupted": self.interrupted,
            "matrix": self.matrix(),
            "totals": self.totals(),
            "value_checks": value_checks_json(self.value),
            "planned": {s: {c: list(ids) for c, ids in r.items()} for s, r in self.planned.items()},
            "declared_unchecked": coverage.declared,
            "unchecked": coverage.unchecked,
            "not_selected": coverage.not_selected,
            "not_applicable": self.not_applicable,
            "cache": self.cache_use(),
            "items": [r.as_json() for r in self.sorted_records()],
        }

    def summary_lines(self, width: int) -> list[str]:
        """Terminal lines: one matrix per scope, totals and skip reasons."""
        if not self.records and not self.not_applicable:
            return ["no exportcheck items ran"]
        lines = matrix_lines(
            self._plain(),
            width,
            self.value,
            self.planned,
            self.declared,
            judged=self.judged,
            not_applicable=self.not_applicable,
        )
        totals = self.totals()
        lines.append(
            f"{sum(totals.values())} items: "
            + ", ".join(f"{totals[o]} {_WORDS[o]}" for o in OUTCOMES)
            + "  (cells: passed/total; F failed, x xfailed, s skipped)"
        )
        if self.not_applicable:
            left = sum(int(c.get("items", 0)) for c in self.not_applicable)
            lines.append(
                f"  {NOT_APPLICABLE} not applicable: {len(self.not_applicable)} (row, check) "
                f"cell(s), {left} item(s) fewer: the rows' declarations exclude them (the JSON "
                "report's not_applicable says why)"
            )
        unfinished = sum(r.outcome == INCOMPLETE for r in self.records.values())
        if unfinished or self.interrupted:
            lines.append(f"interrupted: {unfinished} unfinished item(s) counted as failed")
        for reason, count in self.skip_reasons()[:5]:
            lines.append(f"  skipped {count}x: {reason}")
        lines.append(_cache_line(self.cache_use()))
        return lines

    def durations_lines(self, n: int) -> list[str]:
        """``--export-durations=N``: the slowest ``n`` items and where their time went."""
        lines = []
        for rec in self.slowest(n):
            profile = rec.profile
            parts = [f"{p} {float(profile.get(p, 0.0)):.2f}s" for p in _PROFILE_COLUMNS]
            artifact = _ARTIFACT_WORDS.get(str(profile.get("artifact")), "no shared artifact")
            lines.append(f"{rec.duration:7.2f}s {rec.id}  ({', '.join(parts)}; {artifact})")
        return lines

    def sorted_records(self) -> list[ItemRecord]:
        """Every record, sorted by node id."""
        return sorted(self.records.values(), key=lambda r: r.nodeid)


_WORDS = {"pass": "passed", "fail": "failed", "xfail": "xfailed", "skip": "skipped"}
#: The profile phases ``--export-durations`` shows, in order.
_PROFILE_COLUMNS = ("build", "export", "cache", "load", "compare", "other")
_ARTIFACT_WORDS = {"cached": "artifact from the cache", "exported": "artifact exported"}


def _cache_line(use: Mapping[str, int]) -> str:
    return (
        f"artifact cache: {use['served_from_cache']} items served from the cache, "
        f"{use['exported']} exported ({use['exports']} exports)"
    )


def _fold_outcome(
    record: ItemRecord, report: pytest.TestReport, *, check_failed: bool, called: bool
) -> None:
    """Fold one phase in: a failure or skip at once; a pass only once its teardown reported."""
    if report.failed:
        record.outcome = "fail"
        if not (check_failed and report.when == "call"):
            # a crash, a setup/teardown error, or an XPASS(strict): pytest's own line
            record.message = _failure_message(report)
    elif report.skipped and record.outcome != "fail":
        if hasattr(report, "wasxfail"):
            record.outcome = "xfail"
            record.message = record.message or str(report.wasxfail)
        else:
            record.outcome = "skip"
            record.message = _skip_reason(report)
    elif report.when == "teardown" and called and record.outcome == INCOMPLETE:
        record.outcome = "pass"


def _failure_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", None) or str(report.longrepr)
    return str(message).strip()[:2000]


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(reason).removeprefix(_SKIP_PREFIX)


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` as indented JSON to ``path`` all-or-nothing (:mod:`exportlm.atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_report_pages(data: Mapping[str, Any], html: Path | None, badge: Path | None) -> None:
    """The report as an HTML page and an SVG badge (:mod:`exportlm._report_html`), where asked."""
    if html is not None:
        write_text_atomic(html, report_html(data))
    if badge is not None:
        write_text_atomic(badge, report_badge(data))
