"""The coverage lockfile ``exportcheck.lock``: what a run covered, and what changed since.

JSON in the rootdir: per scope, target or exporter and check, the item ids the
suite collected and their outcome::

    {"exportcheck_lock": 1,
     "items": {"target": {"torchscript:script": {"roundtrip_logits":
                 {"roundtrip_logits[torchscript:script-llama-cpu]": "pass"}}}}}

``--export-lock=update`` writes it (atomically, :mod:`exportlm.atomic`); while the
file exists every run compares with it (``--export-lock=off`` does not). A run
fails when a check disappears from a row, an item that ran becomes a skip, or a
pass becomes an expected failure; new items and skips that now pass are reported. A
check that is not applicable to a row now (its declarations exclude it) and had only
skips there is noted, not a failure; if it ran there before, the row lost coverage.
Only what the run planned is compared: rows and checks it did not select keep
their entries, and items it planned but did not run (``-k``, ``--export-shard``)
are neither compared nor dropped on update. Reading uses :mod:`exportlm.safeio`,
so a FIFO or device at the path is refused before it is opened for reading.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exportlm.atomic import write_text_atomic
from exportlm.errors import NotRegularFileError
from exportlm.safeio import read_regular_text

__all__ = [
    "LOCK_FILE",
    "LOCK_VERSION",
    "LockDiff",
    "LockError",
    "Planned",
    "compare",
    "ran_entries",
    "read_lock",
    "updated",
    "write_lock",
]

LOCK_FILE = "exportcheck.lock"
LOCK_VERSION = 1
_MAX_BYTES = 64 * 1024 * 1024
#: scope -> column -> check -> item id -> outcome
Entries = dict[str, dict[str, dict[str, dict[str, str]]]]
#: ``(scope, column, check)``
Triple = tuple[str, str, str]


class LockError(ValueError):
    """The lockfile cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Planned:
    """What a run planned: its item ids per ``(scope, column, check)``, and its selection.

    ``selects(check)`` says whether the run's check selection includes a check id:
    a check the run did not select has not disappeared. ``inapplicable`` holds the
    triples that cannot apply (the row's declarations exclude the check), with why.
    """

    ids: Mapping[Triple, frozenset[str]]
    selects: Callable[[str], bool]
    inapplicable: Mapping[Triple, str] = field(default_factory=dict)

    @property
    def columns(self) -> set[tuple[str, str]]:
        return {(s, c) for s, c, _ in self.ids}

    def covers(self, triple: Triple) -> bool:
        """Whether the run speaks for ``triple``: its row was planned and its check selected."""
        return triple[:2] in self.columns and self.selects(triple[2])


@dataclass
class LockDiff:
    """Changes against the lockfile: ``failures`` fail the run, ``notes`` are reported."""

    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _triples(entries: Entries) -> Iterable[tuple[Triple, dict[str, str]]]:
    for scope, columns in sorted(entries.items()):
        for column, checks in sorted(columns.items()):
            for check, items in sorted(checks.items()):
                yield (scope, column, check), items


def ran_entries(items: Iterable[Mapping[str, Any]]) -> Entries:
    """The lock entries of the items that ran and finished (an interrupted item is not one)."""
    out: Entries = {}
    for item in items:
        outcome = str(item.get("outcome") or "")
        if not outcome or outcome == "incomplete":
            continue
        checks = out.setdefault(str(item["scope"]), {}).setdefault(str(item["column"]), {})
        checks.setdefault(str(item["check"]), {})[str(item["id"])] = outcome
    return out


def _lookup(entries: Entries, triple: Triple) -> dict[str, str]:
    scope, column, check = triple
    return entries.get(scope, {}).get(column, {}).get(check, {})


def compare(old: Entries, ran: Entries, planned: Planned) -> LockDiff:
    """What changed from ``old`` (the lockfile) to the items that ``ran``."""
    diff = LockDiff()
    for triple, items in _triples(old):
        if not planned.covers(triple):
            continue
        if triple not in planned.ids:
            _gone(diff, triple, items, planned.inapplicable.get(triple))
            continue
        now = _lookup(ran, triple)
        for item_id, before in sorted(items.items()):
            after = now.get(item_id)
            if after is None or after == before:
                continue
            change = f"{item_id}: {before} -> {after}"
            if (after == "skip") or (before == "pass" and after == "xfail"):
                diff.failures.append(change)
            elif before == "skip":
                diff.notes.append(change)
    for triple, items in _triples(ran):
        known = _lookup(old, triple)
        fresh = sorted(i for i in items if i not in known)
        diff.notes += [f"{i}: new item ({items[i]})" for i in fresh]
    return diff


def _gone(diff: LockDiff, triple: Triple, items: Mapping[str, str], reason: str | None) -> None:
    """A check the run has no item of for a row the lockfile lists it in.

    Not applicable now, and only skips before: those were never checks, noted. Anything
    that ran before (a target that stopped declaring a capability) loses coverage.
    """
    scope, column, check = triple
    if reason is not None and all(outcome == "skip" for outcome in items.values()):
        diff.notes.append(
            f"check {check} on {scope} {column} is not applicable ({reason}): its "
            f"{len(items)} skipped item(s) in the lockfile are no items now"
        )
        return
    why = f", not applicable now: {reason}" if reason is not None else ""
    diff.failures.append(
        f"check {check} disappeared from {scope} {column} "
        f"({len(items)} item(s) in the lockfile{why})"
    )


def updated(old: Entries, ran: Entries, planned: Planned) -> Entries:
    """``old`` with every triple the run covered replaced by what it planned and ran."""
    out: Entries = {}
    for triple, items in _triples(old):
        if not planned.covers(triple):
            _put(out, triple, dict(items))
    for triple, ids in planned.ids.items():
        now = _lookup(ran, triple)
        before = _lookup(old, triple)
        merged = {i: now.get(i) or before.get(i) for i in ids}
        _put(out, triple, {i: o for i, o in sorted(merged.items()) if o})
    return out


def _put(entries: Entries, triple: Triple, items: dict[str, str]) -> None:
    if items:
        scope, column, check = triple
        entries.setdefault(scope, {}).setdefault(column, {})[check] = items


def read_lock(path: Path) -> Entries | None:
    """The entries of the lockfile at ``path``; ``None`` when there is none."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        text = read_regular_text(path, what="exportcheck lockfile", max_bytes=_MAX_BYTES)
        data = json.loads(text)
    except (NotRegularFileError, OSError, UnicodeDecodeError, ValueError) as err:
        raise LockError(
            f"exportcheck lockfile {path}: cannot be read as JSON ({err}); fix or delete it, "
            "rewrite it with --export-lock=update, or ignore it with --export-lock=off"
        ) from err
    version = data.get("exportcheck_lock") if isinstance(data, dict) else None
    if version != LOCK_VERSION:
        raise LockError(
            f"exportcheck lockfile {path}: version {version!r}, this plugin reads version "
            f"{LOCK_VERSION}; rewrite it with --export-lock=update"
        )
    entries = data.get("items")
    if not _well_formed(entries):
        raise LockError(
            f"exportcheck lockfile {path}: 'items' is not "
            "{scope: {column: {check: {item id: outcome}}}}; rewrite it with --export-lock=update"
        )
    result: Entries = entries
    return result


def _well_formed(entries: Any, depth: int = 0) -> bool:
    if depth == 4:
        return isinstance(entries, str)
    return isinstance(entries, dict) and all(
        isinstance(k, str) and _well_formed(v, depth + 1) for k, v in entries.items()
    )


def write_lock(path: Path, entries: Entries) -> None:
    """Write the lockfile all-or-nothing."""
    data = {"exportcheck_lock": LOCK_VERSION, "items": entries}
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
