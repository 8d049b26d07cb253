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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "OUTCOMES",
    "VERSION_KEYS",
    "MergeError",
    "matrix_lines",
    "matrix_of",
    "merge_reports",
    "render_matrix",
    "totals_of",
    "unchecked_of",
]

#: Outcomes of an item, in matrix order.
OUTCOMES = ("pass", "fail", "xfail", "skip")
#: Outcomes by which an item checked something (a failure checked, and found a fault).
_CHECKED = frozenset({"pass", "fail"})
_SCOPE_ORDER = {"target": 0, "exporter": 1}
_FLAGS = (("fail", "F"), ("xfail", "x"), ("skip", "s"))
#: Options that may differ between the reports of one merged run: where a job writes,
#: what it runs on (one report per device), which shard it is, how strict its own verdict.
PER_JOB_OPTIONS = frozenset(
    {
        "shard",
        "device",
        "require_device",
        "report",
        "durations",
        "goldens_dir",
        "xfails_file",
        "no_cache",
        "strict",
        "strict_allow",
        "lock",
        "engines",
        "require_engines",
    }
)
#: Environment keys that must agree: the versions of the code that judged the items.
VERSION_KEYS = ("exportlm", "pytest_exportcheck")

Item = Mapping[str, Any]


class MergeError(ValueError):
    """Reports that cannot be merged: the message names the differing key or items."""


def _outcome(item: Item) -> str:
    return str(item.get("outcome") or "pass")


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


def unchecked_of(
    items: Iterable[Item], value_checks: Mapping[str, Iterable[str]]
) -> dict[str, list[str]]:
    """``{scope: [column, ...]}``: columns with value-check items, none of which passed or failed.

    ``value_checks`` names, per scope, the checks that compare what an export
    produced (logits, tensors, goldens). A column all of whose value-check items
    were skipped (or expected to fail) was never checked, whatever else passed.
    A column without any value-check item (a selection without them) is not
    judged.
    """
    wanted = {scope: frozenset(checks) for scope, checks in value_checks.items()}
    seen: dict[tuple[str, str], bool] = {}
    for item in items:
        scope, column = str(item["scope"]), str(item["column"])
        if item["check"] not in wanted.get(scope, ()):
            continue
        key = (scope, column)
        seen[key] = seen.get(key, False) or _outcome(item) in _CHECKED
    out: dict[str, list[str]] = {}
    for (scope, column), checked in sorted(
        seen.items(), key=lambda kv: (_scope_key(kv[0][0]), kv[0][1])
    ):
        if not checked:
            out.setdefault(scope, []).append(column)
    return out


def _cell(counts: Mapping[str, int] | None) -> str:
    if not counts:
        return "-"
    total = sum(counts.values())
    text = f"{counts['pass']}/{total}"
    flags = " ".join(f"{flag}{counts[o]}" for o, flag in _FLAGS if counts[o])
    return f"{text} {flags}" if flags else text


def render_matrix(
    title: str,
    rows: list[str],
    columns: Mapping[str, Mapping[str, Mapping[str, int]]],
    width: int,
) -> list[str]:
    """A check (rows) x target/exporter (columns) table, split into blocks fitting ``width``."""
    label_width = max(len(title), *(len(r) for r in rows))
    names = list(columns)
    cells = {c: {r: _cell(columns[c].get(r)) for r in rows} for c in names}
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
    items: Sequence[Item], width: int, value_checks: Mapping[str, Iterable[str]]
) -> list[str]:
    """One table per scope (rows in catalogue order), each followed by its unchecked columns."""
    order = {str(i["check"]): (int(i.get("check_index", 0)), str(i["check"])) for i in items}
    unchecked = unchecked_of(items, value_checks)
    lines: list[str] = []
    for scope, columns in matrix_of(items).items():
        checks = sorted({c for cells in columns.values() for c in cells}, key=order.__getitem__)
        lines += render_matrix(f"check \\ {scope}", checks, columns, width)
        if unchecked.get(scope):
            lines.append(
                f"UNCHECKED {scope}(s), no value check ran (all skipped or xfailed): {', '.join(unchecked[scope])}"
            )
        lines.append("")
    return lines


def merge_reports(reports: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """One report from several ``(name, report)`` of one suite run in parts (shards, devices).

    Items are the union by node id; the same item with two outcomes, reports of
    different exportlm / plugin versions, report formats or options (those in
    :data:`PER_JOB_OPTIONS` aside) raise :class:`MergeError` naming them. The
    matrix, totals and unchecked columns are recomputed from the merged items.
    """
    if not reports:
        raise MergeError("no reports to merge")
    first_name, first = reports[0]
    for name, report in reports[1:]:
        _same(first_name, first, name, report)
    items: dict[str, dict[str, Any]] = {}
    where: dict[str, str] = {}
    clashes: list[str] = []
    for name, report in reports:
        for item in report.get("items", []):
            nodeid = str(item["nodeid"])
            old = items.get(nodeid)
            if old is None:
                items[nodeid] = dict(item)
                where[nodeid] = name
            elif _outcome(old) != _outcome(item):
                clashes.append(
                    f"{nodeid}: {_outcome(old)} in {where[nodeid]}, {_outcome(item)} in {name}"
                )
    if clashes:
        raise MergeError(
            f"{len(clashes)} item(s) with different outcomes: " + "; ".join(clashes[:10])
        )
    merged = [items[n] for n in sorted(items)]
    value_checks = first.get("value_checks", {})
    options = {k: v for k, v in first.get("options", {}).items() if k not in PER_JOB_OPTIONS}
    return {
        **{k: v for k, v in first.items() if k not in ("items", "options")},
        "options": options,
        "merged_from": [name for name, _ in reports],
        "matrix": matrix_of(merged),
        "totals": totals_of(merged),
        "unchecked": unchecked_of(merged, value_checks),
        "cache": _summed_cache(r for _, r in reports),
        "items": merged,
    }


def _summed_cache(reports: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for report in reports:
        total.update({k: int(v) for k, v in report.get("cache", {}).items()})
    return dict(sorted(total.items()))


def _same(a_name: str, a: Mapping[str, Any], b_name: str, b: Mapping[str, Any]) -> None:
    """Raise :class:`MergeError` naming the first key in which ``a`` and ``b`` differ."""
    pairs: list[tuple[str, Any, Any]] = [("format", a.get("format"), b.get("format"))]
    a_env, b_env = a.get("environment", {}), b.get("environment", {})
    pairs += [(f"environment.{k}", a_env.get(k), b_env.get(k)) for k in VERSION_KEYS]
    a_opt, b_opt = a.get("options", {}), b.get("options", {})
    keys = sorted((set(a_opt) | set(b_opt)) - PER_JOB_OPTIONS)
    pairs += [(f"options.{k}", a_opt.get(k), b_opt.get(k)) for k in keys]
    pairs.append(("value_checks", a.get("value_checks"), b.get("value_checks")))
    for key, left, right in pairs:
        if left != right:
            raise MergeError(
                f"{b_name} differs from {a_name} in {key}: {right!r} != {left!r}; "
                "merge only the reports of one suite run (same versions and options)"
            )
