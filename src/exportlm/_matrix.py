"""The conformance matrix of exportcheck JSON reports, and their merge: pure data, stdlib only.

The pytest plugin (``pytest_exportcheck``) writes a JSON report per run
(``--export-report``); one CI job per shard or device writes one each. This
module is the one place that turns the report's per-item records into the
matrix (``{scope: {column: {check: {outcome: count}}}}``), finds the *unchecked*
columns (every value-check item skipped), renders the terminal table, and
merges several reports into one (``exportlm report merge``). It lives in the
library, not in the plugin, because both sides need it and the library never
imports the plugin; it imports nothing but the standard library, so neither
side pulls torch or pytest in through it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from exportlm._report_schema import (
    INCOMPLETE,
    PER_JOB_OPTIONS,
    REPORT_FORMAT,
    VERSION_KEYS,
    MergeError,
    check_report,
    check_same,
    check_shards,
    not_applicable_of,
)

__all__ = [
    "INCOMPLETE",
    "NOT_APPLICABLE",
    "OUTCOMES",
    "PER_JOB_OPTIONS",
    "REPORT_FORMAT",
    "VERSION_KEYS",
    "Rows",
    "Coverage",
    "MergeError",
    "coverage_of",
    "matrix_lines",
    "matrix_of",
    "merge_problems",
    "merge_reports",
    "render_matrix",
    "totals_of",
    "unchecked_of",
]

#: Outcomes of an item, in matrix order (an ``incomplete`` item counts as ``fail``).
OUTCOMES = ("pass", "fail", "xfail", "skip")
#: Outcomes by which an item checked something (a failure checked, and found a fault).
_CHECKED = frozenset({"pass", "fail"})
_SCOPE_ORDER = {"target": 0, "exporter": 1}
_FLAGS = (("fail", "F"), ("xfail", "x"), ("skip", "s"))
#: A cell that cannot apply (no item: the check's needs exclude the row).
NOT_APPLICABLE = "·"
Item = Mapping[str, Any]
#: ``{scope: {column: value}}``
Rows = Mapping[str, Mapping[str, Any]]


def _outcome(item: Item) -> str:
    """The item's matrix outcome: an unfinished item (no outcome) counts as failed."""
    outcome = str(item.get("outcome") or INCOMPLETE)
    return "fail" if outcome == INCOMPLETE else outcome


def _scope_key(scope: str) -> tuple[int, str]:
    return (_SCOPE_ORDER.get(scope, len(_SCOPE_ORDER)), scope)


def matrix_of(items: Iterable[Item]) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
    """``{scope: {column: {check: {outcome: count}}}}``, scopes, columns and checks sorted."""
    out: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    for item in sorted(items, key=lambda i: str(i["nodeid"])):
        cell = (
            out.setdefault(str(item["scope"]), {})
            .setdefault(str(item["column"]), {})
            .setdefault(str(item["check"]), dict.fromkeys(OUTCOMES, 0))
        )
        cell[_outcome(item)] += 1
    return {s: {c: out[s][c] for c in sorted(out[s])} for s in sorted(out, key=_scope_key)}


def totals_of(items: Iterable[Item]) -> dict[str, int]:
    """Item counts per outcome."""
    counts = Counter(_outcome(i) for i in items)
    return {o: counts.get(o, 0) for o in OUTCOMES}


@dataclass(frozen=True)
class Coverage:
    """The rows (``{scope: [column]}``) whose value checks checked nothing, by why.

    ``unchecked``: every value-check item of the row ran, none passed or failed; this
    fails ``--export-strict``. ``declared``: such rows that their target declares it
    cannot check (``{scope: {column: reason}}``), shown and never a failure.
    ``not_selected``: rows some of whose value-check items were deselected (``-k``,
    ``-m``, ``--export-checks``) and none of those that ran checked: not judged.
    """

    unchecked: dict[str, list[str]] = field(default_factory=dict)
    declared: dict[str, dict[str, str]] = field(default_factory=dict)
    not_selected: dict[str, list[str]] = field(default_factory=dict)


def _by_scope(rows: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for scope, column in sorted(rows, key=lambda r: (_scope_key(r[0]), r[1])):
        out.setdefault(scope, []).append(column)
    return out


def coverage_of(
    items: Iterable[Item],
    value_checks: Mapping[str, Iterable[str]],
    planned: Rows | None = None,
    declared: Rows | None = None,
    *,
    judged: set[tuple[str, str]] | None = None,
    not_applicable: Iterable[Item] = (),
) -> Coverage:
    """Judge each row by its value-check items (see :class:`Coverage`).

    ``planned`` is ``{scope: {column: [value-check item id]}}`` of every check (not
    only the selected ones): a row with a planned id that did not run was narrowed.
    ``declared`` is ``{scope: {column: reason}}``. Without ``planned`` every row with
    value-check items is judged; a row without any is never judged. With ``judged``
    (a shard's whole rows), only those rows are.
    """
    wanted = {scope: frozenset(checks) for scope, checks in value_checks.items()}
    checked: dict[tuple[str, str], bool] = {}
    ran: dict[tuple[str, str], set[str]] = {}
    present: set[tuple[str, str]] = set()
    for item in items:
        row = (str(item["scope"]), str(item["column"]))
        if judged is not None and row not in judged:
            continue
        present.add(row)
        if item["check"] in wanted.get(row[0], ()):
            checked[row] = checked.get(row, False) or _outcome(item) in _CHECKED
            ran.setdefault(row, set()).add(str(item.get("id", item["nodeid"])))
    for cell in not_applicable:
        row = (str(cell["scope"]), str(cell["column"]))
        if row in present and cell["check"] in wanted.get(row[0], ()):
            checked.setdefault(row, False)
    narrowed = {
        (scope, column)
        for scope, columns in (planned or {}).items()
        for column, ids in columns.items()
        if (scope, column) in present and not set(ids) <= ran.get((scope, column), set())
    }
    idle = {row for row in present if not checked.get(row, False)}
    reasons = {(s, c): str(r) for s, cols in (declared or {}).items() for c, r in cols.items()}
    said = {row for row in idle if row in reasons and (row in checked or row in narrowed)}
    return Coverage(
        unchecked=_by_scope(r for r in idle if r in checked and r not in narrowed | said),
        declared={s: {c: reasons[(s, c)] for c in cs} for s, cs in _by_scope(said).items()},
        not_selected=_by_scope(r for r in idle & narrowed if r not in said),
    )


def unchecked_of(
    items: Iterable[Item], value_checks: Mapping[str, Iterable[str]]
) -> dict[str, list[str]]:
    """``{scope: [column, ...]}``: columns with value-check items, none of which passed or failed.

    ``value_checks`` names, per scope, the checks that compare what an export
    produced (logits, tensors, goldens). A column all of whose value-check items
    were skipped (or expected to fail) was never checked, whatever else passed.
    A column without any value-check item (a selection without them) is not
    judged. :func:`coverage_of` also knows what was planned and declared.
    """
    return coverage_of(items, value_checks).unchecked


def _cell(counts: Mapping[str, int] | None, applies: bool = True) -> str:
    if not counts:
        return "-" if applies else NOT_APPLICABLE
    total = sum(counts.values())
    text = f"{counts['pass']}/{total}"
    flags = " ".join(f"{flag}{counts[o]}" for o, flag in _FLAGS if counts[o])
    return f"{text} {flags}" if flags else text


def render_matrix(
    title: str,
    rows: list[str],
    columns: Mapping[str, Mapping[str, Mapping[str, int]]],
    width: int,
    blank: Collection[tuple[str, str]] = (),
) -> list[str]:
    """A check (rows) x target/exporter (columns) table, split into blocks fitting ``width``.

    ``blank``: the ``(column, check)`` cells that cannot apply, shown as ``·`` when empty.
    """
    label_width = max(len(title), *(len(r) for r in rows))
    names = list(columns)
    cells = {c: {r: _cell(columns[c].get(r), (c, r) not in blank) for r in rows} for c in names}
    widths = {c: max(len(c), *(len(v) for v in cells[c].values())) for c in names}
    blocks: list[list[str]] = [[]]
    used = label_width
    for name in names:
        if blocks[-1] and used + 2 + widths[name] > width:
            blocks.append([])
            used = label_width
        blocks[-1].append(name)
        used += 2 + widths[name]
    lines: list[str] = []
    for block in blocks:
        if lines:
            lines.append("")
        lines.append(title.ljust(label_width) + "".join("  " + c.rjust(widths[c]) for c in block))
        for row in rows:
            lines.append(
                row.ljust(label_width)
                + "".join("  " + cells[c][row].rjust(widths[c]) for c in block)
            )
    return lines


def matrix_lines(
    items: Sequence[Item],
    width: int,
    value_checks: Mapping[str, Iterable[str]],
    planned: Rows | None = None,
    declared: Rows | None = None,
    *,
    judged: set[tuple[str, str]] | None = None,
    not_applicable: Sequence[Item] = (),
) -> list[str]:
    """One table per scope (rows in catalogue order; ``·``: a cell that cannot apply), each
    followed by its rows that checked nothing: unchecked, declared unchecked, not selected."""
    cells = [*items, *not_applicable]
    order = {str(i["check"]): (int(i.get("check_index", 0)), str(i["check"])) for i in cells}
    coverage = coverage_of(
        items, value_checks, planned, declared, judged=judged, not_applicable=not_applicable
    )
    lines: list[str] = []
    for scope, columns in _with_blank_cells(matrix_of(items), not_applicable).items():
        blank = {(str(c["column"]), str(c["check"])) for c in not_applicable if c["scope"] == scope}
        checks = {c for cells in columns.values() for c in cells} | {c for _, c in blank}
        rows = sorted(checks, key=order.__getitem__)
        lines += render_matrix(f"check \\ {scope}", rows, columns, width, blank)
        lines += _coverage_lines(scope, coverage)
        lines.append("")
    return lines


def _with_blank_cells(
    matrix: Mapping[str, Mapping[str, Mapping[str, Any]]], not_applicable: Iterable[Item]
) -> dict[str, dict[str, Mapping[str, Any]]]:
    """``matrix`` with the scopes and columns that only have cells that cannot apply."""
    out = {scope: dict(columns) for scope, columns in matrix.items()}
    for cell in not_applicable:
        out.setdefault(str(cell["scope"]), {}).setdefault(str(cell["column"]), {})
    return {s: {c: out[s][c] for c in sorted(out[s])} for s in sorted(out, key=_scope_key)}


def _coverage_lines(scope: str, coverage: Coverage) -> list[str]:
    lines = []
    if coverage.unchecked.get(scope):
        lines.append(
            f"UNCHECKED {scope}(s), no value check ran (all skipped or xfailed): "
            + ", ".join(coverage.unchecked[scope])
        )
    for column, reason in coverage.declared.get(scope, {}).items():
        lines.append(
            f"declared unchecked {scope} {column} (its declaration, not a failure): {reason}"
        )
    if coverage.not_selected.get(scope):
        lines.append(
            f"not selected {scope}(s), no value check of theirs selected (-k, -m, "
            f"--export-checks; not judged): {', '.join(coverage.not_selected[scope])}"
        )
    return lines


def _union(reports: Iterable[Mapping[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for report in reports:
        for scope, rows in report.get(key, {}).items():
            for column, value in rows.items():
                cell = out.setdefault(scope, {})
                cell[column] = (
                    sorted(set(cell.get(column, [])) | set(value))
                    if isinstance(value, list)
                    else value
                )
    return out


def _merged_items(reports: Sequence[tuple[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The union of the reports' items by node id; an unfinished item wins over its twin."""
    items: dict[str, dict[str, Any]] = {}
    where: dict[str, str] = {}
    clashes: list[str] = []
    for name, report in reports:
        for item in report["items"]:
            nodeid = str(item["nodeid"])
            old = items.get(nodeid)
            if old is None or item["outcome"] == INCOMPLETE:
                items[nodeid], where[nodeid] = dict(item), name
            elif old["outcome"] != item["outcome"] and old["outcome"] != INCOMPLETE:
                clashes.append(
                    f"{nodeid}: {old['outcome']} in {where[nodeid]}, {item['outcome']} in {name}"
                )
    if clashes:
        raise MergeError(
            f"{len(clashes)} item(s) with different outcomes: " + "; ".join(clashes[:10])
        )
    return [items[n] for n in sorted(items)]


def merge_reports(reports: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """One report from several ``(name, report)`` of one suite run in parts (shards, devices).

    Each report is validated first (:func:`exportlm._report_schema.check_report`: the
    format, every item and its outcome), the shards of each job must be 1..N of N once
    each (:func:`~exportlm._report_schema.check_shards`); items are the union by node
    id; the same item with two outcomes, reports of different exportlm / plugin
    versions or options (those in :data:`PER_JOB_OPTIONS` aside) raise
    :class:`MergeError` naming them. The matrix, totals and coverage are recomputed
    from the merged items; ``interrupted`` names the reports of cancelled runs.
    """
    if not reports:
        raise MergeError("no reports to merge")
    for name, report in reports:
        check_report(name, report)
    first_name, first = reports[0]
    for name, report in reports[1:]:
        check_same(first_name, first, name, report)
    check_shards(reports)
    merged = _merged_items(reports)
    value_checks = first.get("value_checks", {})
    options = {k: v for k, v in first.get("options", {}).items() if k not in PER_JOB_OPTIONS}
    planned = _union((r for _, r in reports), "planned")
    declared = _union((r for _, r in reports), "declared_unchecked")
    inapplicable = not_applicable_of([r for _, r in reports])
    coverage = coverage_of(merged, value_checks, planned, declared, not_applicable=inapplicable)
    return {
        **{k: v for k, v in first.items() if k not in ("items", "options")},
        "options": options,
        "merged_from": [name for name, _ in reports],
        "interrupted": any(r.get("interrupted", False) for _, r in reports),
        "interrupted_reports": [n for n, r in reports if r.get("interrupted", False)],
        "matrix": matrix_of(merged),
        "totals": totals_of(merged),
        "planned": planned,
        "declared_unchecked": coverage.declared,
        "unchecked": coverage.unchecked,
        "not_selected": coverage.not_selected,
        "not_applicable": inapplicable,
        "cache": _summed_cache(r for _, r in reports),
        "items": merged,
    }


def merge_problems(merged: Mapping[str, Any], *, allow_failed: bool = False) -> list[str]:
    """Why ``report merge --strict`` fails ``merged``: interrupted runs, unfinished items,
    failed items (unless ``allow_failed``) and unchecked rows; empty when none."""
    problems = [f"{name}: the run was interrupted" for name in merged["interrupted_reports"]]
    for outcome, word in ((INCOMPLETE, "unfinished"), ("fail", "failed")):
        if outcome == "fail" and allow_failed:
            continue
        ids = [str(i["nodeid"]) for i in merged["items"] if i["outcome"] == outcome]
        if ids:
            more = f" and {len(ids) - 5} more" if len(ids) > 5 else ""
            problems.append(f"{len(ids)} {word} item(s): {', '.join(ids[:5])}{more}")
    rows = [f"{s} {c}" for s, cols in merged["unchecked"].items() for c in cols]
    if rows:
        problems.append(f"{len(rows)} unchecked row(s): {', '.join(rows)}")
    return problems


def _summed_cache(reports: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for report in reports:
        total.update({k: int(v) for k, v in report.get("cache", {}).items()})
    return dict(sorted(total.items()))
