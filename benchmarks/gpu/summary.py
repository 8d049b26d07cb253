"""Step 3 of ``check.sh``: per-check counts, failures and skip reasons from the JSON report.

Usage: ``python summary.py REPORT.json [WALL_SECONDS]``. Prints a table of
passed / failed / xfailed / skipped per check, the failing items with the first
line of their message, the distinct skip reasons, the slowest items and the
wall time. Reads only the report; installs nothing.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

OUTCOMES = ("pass", "fail", "xfail", "skip")


def summarize(report: dict, wall: str | None = None) -> list[str]:
    """The summary lines of a JSON report written by ``--export-report``."""
    items = report.get("items", [])
    env = report.get("environment", {})
    lines = [
        f"torch {env.get('torch', '?')}; {env.get('cuda', '?')}",
        f"float32: {env.get('float32', '?')}",
    ]
    per_check: dict[str, Counter[str]] = defaultdict(Counter)
    for item in items:
        per_check[item["check"]][item["outcome"]] += 1
    width = max((len(c) for c in per_check), default=5)
    lines.append(f"{'check':<{width}}  " + "  ".join(f"{o:>5}" for o in OUTCOMES))
    for check, counts in per_check.items():
        lines.append(f"{check:<{width}}  " + "  ".join(f"{counts[o]:>5}" for o in OUTCOMES))
    totals = Counter(item["outcome"] for item in items)
    lines.append(f"{len(items)} items: " + ", ".join(f"{totals[o]} {o}" for o in OUTCOMES))
    for item in items:
        if item["outcome"] == "fail":
            first = (item.get("message") or "").strip().splitlines()[:1]
            lines.append(f"FAILED {item['id']}: {first[0] if first else '(no message)'}")
    reasons = Counter(item.get("message", "") for item in items if item["outcome"] == "skip")
    for reason, count in reasons.most_common(6):
        lines.append(f"skipped {count}x: {reason[:200]}")
    for item in sorted(items, key=lambda i: -float(i.get("duration", 0)))[:5]:
        lines.append(f"slow: {item['id']} {float(item.get('duration', 0)):.1f}s")
    if wall is not None:
        lines.append(f"wall time: {wall}s")
    return lines


def main(argv: list[str]) -> int:
    """Print the summary of ``argv[1]``; 1 when the report is missing or unreadable."""
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 1
    path = Path(argv[1])
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        print(
            f"no summary: cannot read the report {path} ({err}); see the pytest log",
            file=sys.stderr,
        )
        return 1
    print("\n".join(summarize(report, argv[2] if len(argv) > 2 else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
