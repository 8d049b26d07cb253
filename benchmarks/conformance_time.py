"""The main job's time budget: ``make conformance`` cold, then warm, in an empty directory.

Runs ``python -m pytest -n auto --export-targets=all --export-only
--export-report=... --hypothesis-seed=0`` (what ``make conformance`` runs) twice in
a new temporary directory: first with an empty artifact cache (cold), then again
with the cache the first run left (warm). The cache lives under that directory's
``.pytest_cache``, so the run never touches anyone else's. It prints both wall
times, their ratio, the item counts, the items served from the cache, CPU seconds
(this process's children: every xdist worker), and the 10 slowest items of each
run with where their time went (the ``profile`` of the JSON report).

The budget (docs/checks.md, "Time budget"), on an idle 2-core machine: cold at
most 120 s, warm at least 3x faster than cold. Nothing here asserts a time; the
exit status is 0 when both runs finished with the same item outcomes, 1 otherwise.

Usage: ``python benchmarks/conformance_time.py [--workers auto] [--keep] [-- extra pytest args]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BUDGET_COLD_S = 120.0
BUDGET_WARM_RATIO = 3.0
PHASES = ("build", "export", "cache", "load", "compare", "other")


def _run(directory: Path, label: str, workers: str, extra: list[str]) -> dict[str, Any]:
    report = directory / f"{label}.json"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-n",
        workers,
        "--export-targets=all",
        "--export-only",
        f"--export-report={report}",
        "--hypothesis-seed=0",
        "-p",
        "no:randomly",
        *extra,
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # As `make conformance`: bytecode is kept even where the environment disables it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(
        command, cwd=directory, env=env, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    (directory / f"{label}.log").write_text(done.stdout + done.stderr)
    data = json.loads(report.read_text()) if report.exists() else {"items": [], "totals": {}}
    return {"wall": wall, "cpu": cpu, "status": done.returncode, "report": data}


def _slowest(items: list[dict[str, Any]], n: int = 10) -> list[str]:
    lines = []
    for item in sorted(items, key=lambda i: -float(i.get("duration", 0.0)))[:n]:
        profile = item.get("profile") or {}
        phases = ", ".join(f"{p} {float(profile.get(p, 0.0)):.1f}" for p in PHASES)
        source = profile.get("artifact") or "-"
        lines.append(
            f"  {item['duration']:7.2f}s {item['id']:<50} {item['outcome']:<5} "
            f"({phases}; artifact {source})"
        )
    return lines


def _outcomes(data: dict[str, Any]) -> dict[str, str]:
    return {item["id"]: item["outcome"] for item in data["items"]}


def _print_run(label: str, run: dict[str, Any]) -> None:
    data = run["report"]
    print(
        f"{label}: {run['wall']:.1f} s wall, {run['cpu']:.1f} s CPU, exit {run['status']}, "
        f"{len(data['items'])} items {data.get('totals', {})}, cache {data.get('cache', {})}"
    )
    for line in _slowest(data["items"]):
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--workers", default="auto", help="pytest-xdist -n (default: auto)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("extra", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    directory = Path(tempfile.mkdtemp(prefix="exportlm-conformance-time-"))
    env_note = os.environ.get("PYTHONPATH", "")
    print(f"in {directory} (PYTHONPATH={env_note!r}, {os.cpu_count()} CPUs)")
    try:
        cold = _run(directory, "cold", args.workers, args.extra)
        _print_run("cold", cold)
        warm = _run(directory, "warm", args.workers, args.extra)
        _print_run("warm", warm)
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    ratio = cold["wall"] / warm["wall"] if warm["wall"] else float("inf")
    print(
        f"cold {cold['wall']:.1f} s (budget {BUDGET_COLD_S:.0f} s), warm {warm['wall']:.1f} s, "
        f"cold/warm {ratio:.2f}x (budget >= {BUDGET_WARM_RATIO:.0f}x)"
    )
    same = _outcomes(cold["report"]) == _outcomes(warm["report"])
    print("same items and outcomes cold and warm:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
