"""``exportlm report merge A.json B.json ... [-o all.json] [--strict [--allow-failed]]``.

Merges the JSON reports (``pytest --export-report``) of the jobs of one suite run,
its shards (``--export-shard=K/N``) and devices, with :func:`exportlm._matrix.merge_reports`,
writes the merged report atomically and prints its matrix. Exit codes: 0 merged,
1 with ``--strict`` when the merged run has a failed item (unless ``--allow-failed``),
an unfinished item or an interrupted report, or an unchecked target or exporter,
2 for a usage error: a report that cannot be read (missing, not JSON, nested too
deep, a FIFO or device), that is malformed (another format, an item without a
known outcome), or reports that cannot be merged (different versions or options,
a shard given twice or missing, one item with two outcomes); the message names
the file, key or items.

``exportlm report html A.json [B.json ...] -o report.html [--badge badge.svg]`` reads
and merges the same way and renders the result as one self-contained page
(:mod:`exportlm._report_html`); it exits 0 whatever the verdict (gate with ``merge
--strict``), 2 for the usage errors above.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from exportlm._matrix import MergeError, matrix_lines, merge_problems, merge_reports
from exportlm.atomic import check_output_path, write_text_atomic
from exportlm.cli._errors import EXIT_FAILURE, EXIT_OK, UsageError
from exportlm.errors import NotRegularFileError
from exportlm.safeio import read_regular_text

__all__ = ["add_report_arguments", "cmd_report"]

_MAX_BYTES = 256 * 1024 * 1024
_WORDS = {"pass": "passed", "fail": "failed", "xfail": "xfailed", "skip": "skipped"}


def add_report_arguments(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The ``report`` subcommand's ``merge`` and ``html`` actions; returns their parsers."""
    actions = p.add_subparsers(dest="report_command", metavar="ACTION", required=True)
    merge = actions.add_parser(
        "merge", help="merge the JSON reports of a suite's shards and devices into one"
    )
    merge.add_argument("reports", nargs="+", type=Path, metavar="REPORT.json")
    merge.add_argument("-o", "--output", type=Path, metavar="ALL.json", help="write the merge")
    merge.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when an item failed or never finished, a report was interrupted, or a "
        "target or exporter is unchecked (every value check skipped)",
    )
    merge.add_argument(
        "--allow-failed",
        action="store_true",
        help="with --strict, do not fail on failed items (unfinished items, interrupted "
        "reports and unchecked rows still fail)",
    )
    html = actions.add_parser(
        "html", help="render reports (one run, or a run's shards merged) as one HTML page"
    )
    html.add_argument("reports", nargs="+", type=Path, metavar="REPORT.json")
    html.add_argument(
        "-o", "--output", type=Path, required=True, metavar="REPORT.html", help="the page"
    )
    html.add_argument("--badge", type=Path, metavar="BADGE.svg", help="also an SVG badge")
    return [merge, html]


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_regular_text(path, what="JSON report", max_bytes=_MAX_BYTES))
    except (NotRegularFileError, OSError, UnicodeDecodeError, ValueError) as err:
        raise UsageError(f"report {path}: cannot be read as JSON ({err})") from err
    except RecursionError as err:  # json nests on the C stack
        raise UsageError(
            f"report {path}: nested too deeply to be a report; merge only the reports "
            "pytest --export-report wrote"
        ) from err
    if not isinstance(data, dict) or not isinstance(data.get("items"), list):
        raise UsageError(
            f"report {path}: not an exportcheck JSON report (no 'items' list); "
            "write one with pytest --export-report=PATH.json"
        )
    return data


def _merged(paths: list[Path]) -> tuple[int, dict[str, Any]]:
    """The reports read and merged (validated as a merge validates them), and how many."""
    reports = [(str(path), _read(path)) for path in paths]
    try:
        return len(reports), merge_reports(reports)
    except MergeError as err:
        raise UsageError(str(err)) from err


def cmd_report(args: argparse.Namespace) -> int:
    """Run ``exportlm report merge`` or ``exportlm report html``."""
    if args.report_command == "html":
        return _cmd_html(args)
    count, merged = _merged(args.reports)
    if args.output is not None:
        check_output_path(args.output)
        write_text_atomic(args.output, json.dumps(merged, indent=2, sort_keys=True) + "\n")
    width = shutil.get_terminal_size((100, 24)).columns
    lines = matrix_lines(
        merged["items"],
        width,
        merged.get("value_checks", {}),
        merged["planned"],
        merged["declared_unchecked"],
        not_applicable=merged["not_applicable"],
    )
    for line in lines:
        print(line)
    totals = merged["totals"]
    print(
        f"{sum(totals.values())} items from {count} report(s): "
        + ", ".join(f"{count} {_WORDS.get(o, o)}" for o, count in totals.items())
    )
    unfinished = sum(item["outcome"] == "incomplete" for item in merged["items"])
    if unfinished:
        print(f"  {unfinished} of the failed never finished (incomplete)")
    if args.output is not None:
        print(f"merged report: {args.output}")
    for name in merged["interrupted_reports"]:
        print(f"{name}: interrupted; its unfinished items count as failed")
    problems = merge_problems(merged, allow_failed=args.allow_failed) if args.strict else []
    if problems:
        print("--strict: FAILED, " + "; ".join(problems))
        return EXIT_FAILURE
    return EXIT_OK


def _cmd_html(args: argparse.Namespace) -> int:
    """Render the reports' merge as an HTML page (and a badge); exit 0 whatever the verdict."""
    from exportlm._report_html import report_badge, report_html, verdict_of

    count, merged = _merged(args.reports)
    outputs = [(args.output, report_html(merged))]
    if args.badge is not None:
        outputs.append((args.badge, report_badge(merged)))
    for path, text in outputs:
        check_output_path(path)
        write_text_atomic(path, text)
    print(
        f"{args.output}: {len(merged['items'])} items from {count} report(s), {verdict_of(merged)}"
    )
    return EXIT_OK
