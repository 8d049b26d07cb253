"""Whether two ``--export-report`` JSON files hold the same items with the same outcomes.

A speed change must not change what the suite says: run ``make conformance`` (or
``benchmarks/conformance_time.py --keep``) before and after, then::

    python benchmarks/compare_reports.py before.json after.json

prints the item count of each, every id present in one report only, and every id
whose outcome differs; exit status 0 when there is none of either, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def outcomes(path: Path) -> dict[str, str]:
    """``item id -> outcome`` of one JSON report."""
    data = json.loads(path.read_text())
    return {str(item["id"]): str(item["outcome"]) for item in data["items"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    before, after = outcomes(args.before), outcomes(args.after)
    print(f"before: {len(before)} items, after: {len(after)} items")
    only = sorted(set(before) ^ set(after))
    for item in only:
        print(f"  only in {'before' if item in before else 'after'}: {item}")
    changed = sorted(i for i in set(before) & set(after) if before[i] != after[i])
    for item in changed:
        print(f"  {item}: {before[item]} -> {after[item]}")
    same = not only and not changed
    print("same items and outcomes:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
