"""Whether two ``--export-report`` JSON files hold the same items with the same outcomes.

A speed change must not change what the suite says: run ``make conformance`` (or
``benchmarks/conformance_time.py --keep``) before and after, then::

    python benchmarks/compare_reports.py before.json after.json

prints the item count of each, every id present in one report only, every id whose
outcome differs, and every row whose coverage verdict (``unchecked``,
``declared_unchecked``, ``not_selected``) differs; exit status 0 when there is none,
1 otherwise.

An item of ``before`` that ``after`` lists as not applicable (its ``(scope, column,
check)`` cell is in ``after``'s ``not_applicable``, which counts the items it left out)
is no verdict change when it was a skip: a cell that could never apply was a skip
before it stopped being an item. Those are counted per cell, not listed as missing.
An item that passed, failed or xfailed and is not applicable now is a change (the row
lost a check it ran), and so is a cell that lost more items than it says it left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

#: ``(scope, column, check)``
Cell = tuple[str, str, str]
#: The coverage keys of a report: the rows judged unchecked, declared so, not selected.
VERDICT_KEYS = ("unchecked", "declared_unchecked", "not_selected")


def read(path: Path) -> dict[str, Any]:
    """One JSON report."""
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def outcomes(data: dict[str, Any]) -> dict[str, str]:
    """``item id -> outcome`` of one report."""
    return {str(item["id"]): str(item["outcome"]) for item in data["items"]}


def cells(data: dict[str, Any]) -> dict[str, Cell]:
    """``item id -> (scope, column, check)`` of one report."""
    return {
        str(item["id"]): (str(item["scope"]), str(item["column"]), str(item["check"]))
        for item in data["items"]
    }


def not_applicable(data: dict[str, Any]) -> dict[Cell, tuple[str, int]]:
    """``(scope, column, check) -> (reason, items left out)`` of one report (none before it)."""
    out: dict[Cell, tuple[str, int]] = {}
    for cell in data.get("not_applicable", []):
        key = (str(cell["scope"]), str(cell["column"]), str(cell["check"]))
        reason, left = out.get(key, ("", 0))
        out[key] = (reason or str(cell["reason"]), left + int(cell.get("items", 0)))
    return out


def split_gone(
    before: dict[str, Any], after: dict[str, Any]
) -> tuple[dict[Cell, list[str]], list[str]]:
    """The ids only ``before`` has: ``({cell: ids}`` not applicable now, the others)."""
    was, now = outcomes(before), outcomes(after)
    where = cells(before)
    inapplicable = not_applicable(after)
    gone: dict[Cell, list[str]] = {}
    others: list[str] = []
    for item in sorted(set(was) - set(now)):
        cell = where[item]
        if cell in inapplicable and was[item] == "skip":
            gone.setdefault(cell, []).append(item)
        else:
            others.append(item)
    for cell, ids in list(gone.items()):
        if len(ids) > inapplicable[cell][1]:  # more vanished than the cell says it left out
            others += gone.pop(cell)
    return gone, sorted(others)


def verdict_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The coverage sections that differ, one line each."""
    return [
        f"  {key}: {before.get(key, {})} -> {after.get(key, {})}"
        for key in VERDICT_KEYS
        if before.get(key, {}) != after.get(key, {})
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    before_data, after_data = read(args.before), read(args.after)
    before, after = outcomes(before_data), outcomes(after_data)
    print(f"before: {len(before)} items, after: {len(after)} items")
    print("  before:", dict(sorted(Counter(before.values()).items())))
    print("  after: ", dict(sorted(Counter(after.values()).items())))
    gone, others = split_gone(before_data, after_data)
    if gone:
        reasons = not_applicable(after_data)
        count = sum(len(ids) for ids in gone.values())
        print(
            f"not applicable now, skips before (no verdict change): {count} items, {len(gone)} cells"
        )
        for cell, ids in sorted(gone.items()):
            print(f"  {cell[2]} x {cell[1]}: {len(ids)} ({reasons[cell][0]})")
    only = sorted(set(others) | (set(after) - set(before)))
    for item in only:
        print(f"  only in {'before' if item in before else 'after'}: {item}")
    changed = sorted(i for i in set(before) & set(after) if before[i] != after[i])
    for item in changed:
        print(f"  {item}: {before[item]} -> {after[item]}")
    verdicts = verdict_changes(before_data, after_data)
    if verdicts:
        print("coverage verdicts differ:")
        print("\n".join(verdicts))
    same = not only and not changed and not verdicts
    print("same items, outcomes and verdicts (not-applicable cells aside):", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
