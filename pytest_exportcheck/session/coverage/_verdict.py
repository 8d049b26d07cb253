"""The coverage part of a run's verdict: ``--export-strict``, the lockfile, ``--export-shard``.

One :class:`CoverageVerdict` per session. On the controller (or the single
process) it reads the lockfile when the session starts (a bad one is a usage
error before anything runs) and judges the collected reports when it ends: an
unchecked row under ``--export-strict``, or a lockfile change that loses
coverage, fails the run and is named in the terminal summary. In every process
that collects, it deselects the items of other shards.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from exportlm._matrix import Rows, coverage_of
from pytest_exportcheck.plan import ItemSpec
from pytest_exportcheck.plan._shard import in_shard
from pytest_exportcheck.session.coverage._coverage import (
    ValueChecks,
    not_selected_lines,
    strict_lines,
    value_checks,
)
from pytest_exportcheck.session.coverage._lock import (
    LOCK_FILE,
    Entries,
    LockError,
    Planned,
    compare,
    ran_entries,
    read_lock,
    updated,
    write_lock,
)
from pytest_exportcheck.session.nodes._nodes import ExportCheckItem
from pytest_exportcheck.session.options._options import Options
from pytest_exportcheck.session.reporting._report import ItemRecord

__all__ = ["CoverageVerdict"]

#: Lockfile notes (new items, skips that pass now) printed at most; the rest are counted.
_MAX_NOTES = 20


class CoverageVerdict:
    """Strict coverage, lockfile comparison and shard selection of one run."""

    def __init__(
        self,
        rootpath: Path,
        options: Options,
        specs: list[ItemSpec],
        planned: Rows | None = None,
        declared: Rows | None = None,
        not_applicable: list[dict[str, Any]] | None = None,
        value: ValueChecks | None = None,
    ) -> None:
        self.options = options
        #: the value checks per scope (default: every registered check's own ``value``)
        self.value = value_checks() if value is None else value
        self.specs = specs
        #: every row's value-check item ids (all checks) and the rows declared not checkable
        self.planned = planned or {}
        self.declared = declared or {}
        #: the (row, check) cells that cannot apply (report records, with the reason)
        self.not_applicable = not_applicable or []
        self.path = rootpath / LOCK_FILE
        self.old: Entries | None = None
        shard = options.shard
        self.kept: set[str] | None = (
            None if shard is None else {s.name for s in in_shard(specs, shard)}
        )
        #: ``(line, red)`` for the terminal summary.
        self.lines: list[tuple[str, bool]] = []

    def load(self) -> None:
        """Read the lockfile (unless ``--export-lock=off``); a bad one is a usage error."""
        if self.options.lock == "off":
            return
        try:
            self.old = read_lock(self.path)
        except LockError as err:
            raise pytest.UsageError(str(err)) from None

    def deselect_other_shards(self, session: pytest.Session, items: list[pytest.Item]) -> None:
        """With ``--export-shard=K/N``: deselect the suite items of the other shards.

        Items that are not the suite's (the repo's own tests) run in shard 1 only.
        """
        shard = self.options.shard
        if shard is None or self.kept is None:
            return
        kept = self.kept

        def keep(item: pytest.Item) -> bool:
            if isinstance(item, ExportCheckItem):
                return item.name in kept
            return shard.index == 1

        dropped = [item for item in items if not keep(item)]
        if dropped:
            session.config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if keep(item)]

    def judged_rows(self) -> set[tuple[str, str]] | None:
        """Under a shard, the rows whose every value-check item is in this shard."""
        if self.kept is None:
            return None
        whole: dict[tuple[str, str], bool] = {}
        for spec in self.specs:
            if spec.check in self.value.get(spec.scope, ()):
                row = (spec.scope, spec.column)
                whole[row] = whole.get(row, True) and spec.name in self.kept
        return {row for row, inside in whole.items() if inside}

    def _planned(self) -> Planned:
        ids: dict[tuple[str, str, str], set[str]] = {}
        for spec in self.specs:
            ids.setdefault((spec.scope, spec.column, spec.check), set()).add(spec.name)
        checks = self.options.checks
        return Planned(
            {k: frozenset(v) for k, v in ids.items()},
            lambda check: checks.all or check in checks.names,
            {(c["scope"], c["column"], c["check"]): c["reason"] for c in self.not_applicable},
        )

    def judge(self, records: list[ItemRecord]) -> bool:
        """Judge the run's records; True when coverage fails the run."""
        items: list[dict[str, Any]] = [asdict(r) for r in records]
        failed = False
        coverage = coverage_of(
            items,
            self.value,
            self.planned,
            self.declared,
            judged=self.judged_rows(),
            not_applicable=self.not_applicable,
        )
        rows = coverage.unchecked
        allowed = dict(self.options.strict_allow)
        accepted = {s: [c for c in cols if c in allowed] for s, cols in rows.items()}
        rows = {s: [c for c in cols if c not in allowed] for s, cols in rows.items()}
        rows = {s: cols for s, cols in rows.items() if cols}
        if self.options.strict:
            self.lines += [
                (
                    f"exportcheck --export-strict: {column} is unchecked, allowed: {allowed[column]}",
                    False,
                )
                for columns in accepted.values()
                for column in columns
            ]
        self.lines += [(line, False) for line in not_selected_lines(coverage.not_selected)]
        if rows and self.options.strict:
            self.lines += [(line, True) for line in strict_lines(rows)]
            failed = True
        if self.options.lock == "update":
            entries = updated(self.old or {}, ran_entries(items), self._planned())
            write_lock(self.path, entries)
            count = sum(len(i) for s in entries.values() for c in s.values() for i in c.values())
            self.lines.append((f"exportcheck: wrote {self.path} ({count} items)", False))
        elif self.old is not None:
            failed = self._compare(items) or failed
        return failed

    def _compare(self, items: list[dict[str, Any]]) -> bool:
        diff = compare(self.old or {}, ran_entries(items), self._planned())
        if diff.failures:
            self.lines.append(
                (
                    f"exportcheck lockfile {self.path}: FAILED, {len(diff.failures)} change(s) "
                    "lose coverage (rewrite it with --export-lock=update if intended):",
                    True,
                )
            )
            self.lines += [(f"  {change}", True) for change in diff.failures]
        if diff.notes:
            self.lines.append((f"exportcheck lockfile: {len(diff.notes)} change(s) noted:", False))
            self.lines += [(f"  {note}", False) for note in diff.notes[:_MAX_NOTES]]
            if len(diff.notes) > _MAX_NOTES:
                self.lines.append((f"  ... and {len(diff.notes) - _MAX_NOTES} more", False))
        return bool(diff.failures)

    def summary(self, terminal: Any) -> None:
        """Write the verdict's lines into the terminal summary."""
        for line, red in self.lines:
            terminal.write_line(line, red=red)
