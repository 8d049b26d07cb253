"""What an exportcheck JSON report must hold before it is merged or judged: stdlib only.

A report is read from a file a CI job uploaded, so nothing in it is trusted:
:func:`check_report` refuses, naming the file and the item, a report of another
format, one nested deeper than any report is, a malformed item and an item without
a known outcome (an item that never finished is written ``incomplete``, never left
blank); :func:`check_shards` refuses shards of one job that repeat or leave a part
out; :func:`check_same` refuses reports of other versions or options. Every refusal is a
:class:`MergeError`, never a ``KeyError`` or ``TypeError``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "INCOMPLETE",
    "ITEM_OUTCOMES",
    "REPORT_FORMAT",
    "PER_JOB_OPTIONS",
    "VERSION_KEYS",
    "MergeError",
    "check_report",
    "check_same",
    "check_shards",
    "not_applicable_of",
]

#: The report format this exportlm writes and reads. 2: items start ``incomplete``,
#: ``interrupted``, ``planned`` and ``declared_unchecked`` (format 1 wrote an unfinished
#: item's outcome as ``""``, which read as a pass). An optional ``not_applicable`` list
#: (the (row, check) cells that cannot apply, with the reason) needs no new format: a
#: report without it has none.
REPORT_FORMAT = 2
#: An item that started and never finished (the run was interrupted in it).
INCOMPLETE = "incomplete"
#: The outcomes an item record may have.
ITEM_OUTCOMES = ("pass", "fail", "xfail", "skip", INCOMPLETE)
#: No report nests deeper than this (items' ``details`` included).
MAX_DEPTH = 32
_SHARD = re.compile(r"([1-9][0-9]*)/([1-9][0-9]*)")
_ITEM_TEXT = ("nodeid", "id", "check", "scope", "column")
#: The names and the reason of a ``not_applicable`` record.
_CELL_TEXT = ("scope", "column", "check", "reason")
#: The options that say which job of a run wrote a report (its shard aside).
_JOB_KEYS = ("device", "require_device", "engines", "require_engines")


#: Options that may differ between the reports of one merged run: where a job writes,
#: what it runs on (one report per device), which shard it is, how strict its own verdict.
PER_JOB_OPTIONS = frozenset(
    {
        "shard",
        "device",
        "require_device",
        "report",
        "report_absolute_paths",
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


class MergeError(ValueError):
    """Reports that cannot be merged: the message names the file, key or items."""


def _depth_ok(data: Any) -> bool:
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        if isinstance(value, dict):
            stack += [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            stack += [(v, depth + 1) for v in value]
    return True


def _fail(name: str, what: str) -> MergeError:
    return MergeError(
        f"report {name}: {what}; merge only the reports pytest --export-report wrote "
        f"(format {REPORT_FORMAT}), unedited"
    )


def _check_top(name: str, data: Any) -> None:
    if not isinstance(data, dict):
        raise _fail(name, f"a JSON {type(data).__name__}, not a report object")
    if data.get("format") != REPORT_FORMAT:
        raise _fail(
            name,
            f"report format {data.get('format')!r}, this exportlm reads format {REPORT_FORMAT} "
            "(write the report again with the pytest_exportcheck of this exportlm)",
        )
    for key in ("options", "environment", "value_checks", "planned", "declared_unchecked"):
        if not isinstance(data.get(key, {}), dict):
            raise _fail(name, f"{key!r} is not an object")
    if not isinstance(data.get("items"), list):
        raise _fail(name, "no 'items' list")
    if not isinstance(data.get("interrupted", False), bool):
        raise _fail(name, "'interrupted' is not true or false")
    cache = data.get("cache", {})
    if not isinstance(cache, dict) or not all(type(v) is int for v in cache.values()):
        raise _fail(name, "'cache' is not an object of counts")
    _check_names(name, "value_checks", data.get("value_checks", {}), list)
    _check_names(name, "planned", data.get("planned", {}), dict)
    for scope, rows in data.get("planned", {}).items():
        _check_names(name, f"planned.{scope}", rows, list)
    for scope, rows in data.get("declared_unchecked", {}).items():
        if not isinstance(rows, dict) or not all(isinstance(r, str) for r in rows.values()):
            raise _fail(name, f"'declared_unchecked.{scope}' is not {{row: reason}}")
    cells = data.get("not_applicable", [])
    if not isinstance(cells, list) or not all(_cell_ok(c) for c in cells):
        raise _fail(
            name,
            "'not_applicable' is not a list of {scope, column, check, reason, items, "
            "check_index} records",
        )


def _cell_ok(cell: Any) -> bool:
    """Whether ``cell`` is a ``not_applicable`` record: names, a reason, counts."""
    return (
        isinstance(cell, dict)
        and all(isinstance(cell.get(k), str) and cell[k] for k in _CELL_TEXT)
        and type(cell.get("items", 0)) is int
        and cell.get("items", 0) >= 0
        and type(cell.get("check_index", 0)) is int
    )


def not_applicable_of(reports: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``not_applicable`` records of ``reports``, each (row, check, reason) once, sorted."""
    cells: dict[tuple[str, ...], dict[str, Any]] = {}
    for report in reports:
        for cell in report.get("not_applicable", []):
            key = tuple(str(cell[k]) for k in _CELL_TEXT)
            cells.setdefault(key, dict(cell))
    return [cells[k] for k in sorted(cells)]


def _check_names(name: str, key: str, mapping: Mapping[str, Any], kind: type) -> None:
    for sub, value in mapping.items():
        if not isinstance(value, kind):
            raise _fail(name, f"'{key}.{sub}' is not a {kind.__name__}")
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise _fail(name, f"'{key}.{sub}' is not a list of names")


def _check_item(name: str, index: int, item: Any) -> str:
    if not isinstance(item, dict):
        raise _fail(name, f"items[{index}] is a JSON {type(item).__name__}, not an item record")
    label = item.get("nodeid") if isinstance(item.get("nodeid"), str) else f"items[{index}]"
    for key in _ITEM_TEXT:
        if not isinstance(item.get(key), str) or not item[key]:
            raise _fail(name, f"item {label}: {key!r} is missing or not a name")
    outcome = item.get("outcome")
    if outcome not in ITEM_OUTCOMES:
        raise _fail(
            name,
            f"item {label}: outcome {outcome!r} is not one of {', '.join(ITEM_OUTCOMES)} "
            "(an item without an outcome never reported one: it is not a pass)",
        )
    if type(item.get("check_index", 0)) is not int:
        raise _fail(name, f"item {label}: 'check_index' is not an integer")
    for key in ("model", "device"):
        if not isinstance(item.get(key), (str, type(None))):
            raise _fail(name, f"item {label}: {key!r} is not a name or null")
    return str(item["nodeid"])


def check_report(name: str, data: Any) -> None:
    """Raise :class:`MergeError` naming ``name`` unless ``data`` is a well-formed report."""
    if not _depth_ok(data):
        raise _fail(name, f"nested deeper than {MAX_DEPTH} levels")
    _check_top(name, data)
    seen: set[str] = set()
    for index, item in enumerate(data["items"]):
        nodeid = _check_item(name, index, item)
        if nodeid in seen:
            raise _fail(name, f"item {nodeid} is listed twice")
        seen.add(nodeid)


def _job(report: Mapping[str, Any]) -> str:
    options = report.get("options", {})
    return ", ".join(f"{k}={options.get(k)!r}" for k in _JOB_KEYS)


def _shard(name: str, report: Mapping[str, Any]) -> tuple[int, int] | None:
    text = report.get("options", {}).get("shard")
    if text is None:
        return None
    match = _SHARD.fullmatch(str(text))
    if match is None or int(match[1]) > int(match[2]):
        raise _fail(name, f"shard {text!r} is not K/N with 1 <= K <= N")
    return int(match[1]), int(match[2])


def check_shards(reports: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """Refuse the reports of one job (device, engines) unless they are its shards 1..N of N
    exactly once each, or its one whole run."""
    jobs: dict[str, list[tuple[str, tuple[int, int] | None]]] = {}
    for name, report in reports:
        jobs.setdefault(_job(report), []).append((name, _shard(name, report)))
    for job, parts in jobs.items():
        names = ", ".join(n for n, _ in parts)
        whole = [n for n, s in parts if s is None]
        if whole and len(parts) > 1:
            raise MergeError(
                f"reports {names} are all of the job ({job}) and {whole[0]} is its whole run: "
                "merge each job's shards once each, or its one whole-run report"
            )
        if whole:
            continue
        _complete(job, [(n, s) for n, s in parts if s is not None])


def _complete(job: str, parts: list[tuple[str, tuple[int, int]]]) -> None:
    counts = {n for _, (_, n) in parts}
    if len(counts) > 1:
        raise MergeError(
            f"shards of the job ({job}) split the suite differently: "
            + ", ".join(f"{name} is {k}/{n}" for name, (k, n) in parts)
        )
    (total,) = counts
    given: dict[int, str] = {}
    for name, (index, _) in parts:
        if index in given:
            raise MergeError(
                f"shard {index}/{total} of the job ({job}) given twice: {given[index]} and "
                f"{name}; each shard's report once"
            )
        given[index] = name
    missing = [f"{k}/{total}" for k in range(1, total + 1) if k not in given]
    if missing:
        raise MergeError(
            f"shard(s) {', '.join(missing)} of the job ({job}) missing: their items would "
            "vanish from the merge; add their reports (a cancelled shard's report counts its "
            "unfinished items as failed)"
        )


def check_same(a_name: str, a: Mapping[str, Any], b_name: str, b: Mapping[str, Any]) -> None:
    """Raise :class:`MergeError` naming the first key in which ``a`` and ``b`` differ."""
    pairs: list[tuple[str, Any, Any]] = []
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
