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

With ``--exports`` it also lists every export the runs made: a ``conftest.py`` in the
temporary directory wraps ``exportlm.export.targets.run_export`` (what every
``export_model`` call ends in, cached or not) and records the target, the model, its
options, the item and the export's CPU seconds (``time.process_time`` of the worker, which
runs one item at a time); the summary gives the count and CPU seconds per target and per
(target, check), and the most expensive exports.

Usage: ``python benchmarks/conformance_time.py [--workers auto] [--keep] [--exports]
[-- extra pytest args]``
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


#: The ``conftest.py`` of ``--exports``: one JSON line per export into ``$EXPORTS_LOG``.
EXPORTS_PROBE = """
import json, os, time


def pytest_configure(config):
    import exportlm.export.targets as targets

    real = targets.run_export

    def run_export(info, factory, model, output_path, options):
        cpu, error = time.process_time(), None
        try:
            return real(info, factory, model, output_path, options)
        except BaseException as err:
            error = type(err).__name__
            raise
        finally:
            config_ = getattr(model, "config", None)
            record = {
                "target": info.name,
                "model": getattr(config_, "model_type", None) or type(model).__name__,
                "layers": getattr(config_, "num_hidden_layers", getattr(config_, "num_layers", None)),
                "options": sorted(f"{k}={v!r}"[:40] for k, v in options.items()),
                "item": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].split("::")[-1],
                "cpu": time.process_time() - cpu,
                "error": error,
            }
            with open(os.environ["EXPORTS_LOG"], "a") as log:
                log.write(json.dumps(record) + "\\n")

    targets.run_export = run_export
"""


def _exports_summary(log: Path, n: int = 12) -> list[str]:
    """Count and CPU seconds per target and per (target, check), and the ``n`` dearest exports."""
    if not log.exists():
        return ["  no exports recorded"]
    records = [json.loads(line) for line in log.read_text().splitlines() if line]
    lines = [f"  {len(records)} exports, {sum(r['cpu'] for r in records):.1f} CPU s"]
    groups: dict[tuple[str, ...], list[float]] = {}
    for r in records:
        groups.setdefault((r["target"],), []).append(r["cpu"])
        groups.setdefault((r["target"], r["item"].split("[", 1)[0]), []).append(r["cpu"])
    for key, cpus in sorted(groups.items(), key=lambda kv: (kv[0][0], -sum(kv[1]))):
        lines.append(f"  {' / '.join(key):<40} {len(cpus):4d} exports {sum(cpus):7.1f} CPU s")
    for r in sorted(records, key=lambda r: -r["cpu"])[:n]:
        what = f"{r['target']} {r['model']} layers={r['layers']} {' '.join(r['options'])}"
        lines.append(f"  {r['cpu']:6.2f} CPU s {what:<60} {r['error'] or 'ok':<18} {r['item']}")
    return lines


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
    env["EXPORTS_LOG"] = str(directory / f"{label}-exports.jsonl")
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
    parser.add_argument("--exports", action="store_true", help="list every export of each run")
    parser.add_argument("extra", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    directory = Path(tempfile.mkdtemp(prefix="exportlm-conformance-time-"))
    env_note = os.environ.get("PYTHONPATH", "")
    print(f"in {directory} (PYTHONPATH={env_note!r}, {os.cpu_count()} CPUs)")
    if args.exports:
        (directory / "conftest.py").write_text(EXPORTS_PROBE)
    try:
        cold = _run(directory, "cold", args.workers, args.extra)
        _print_run("cold", cold)
        if args.exports:
            print("\n".join(_exports_summary(directory / "cold-exports.jsonl")))
        warm = _run(directory, "warm", args.workers, args.extra)
        _print_run("warm", warm)
        if args.exports:
            print("\n".join(_exports_summary(directory / "warm-exports.jsonl")))
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
