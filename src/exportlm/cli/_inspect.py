"""``exportlm inspect PATH``: check a checkpoint directory or an ONNX file against the
serving loaders' rules (:mod:`exportlm.inspection`).

Exit codes: 0 when no error-level rule fails, 1 when one does, 2 for a usage
error (a path that does not exist or is neither a checkpoint nor an ONNX file) and
for a file that cannot be read: a FIFO, a device or a directory where a file is
expected is refused before it is read (never waited on), as is one that the OS
will not open.
The findings go to standard output: a table, or one JSON object with ``--json``.
``--rules`` lists the rules instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from exportlm.cli._errors import EXIT_FAILURE, EXIT_OK, UsageError
from exportlm.cli._list import print_table
from exportlm.errors import InvalidInputError, NotRegularFileError

__all__ = ["add_inspect_arguments", "cmd_inspect"]


def add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    """The ``inspect`` subcommand's arguments."""
    p.add_argument(
        "path",
        nargs="?",
        type=Path,
        help="a Hugging Face checkpoint directory (safetensors + configs) or an .onnx file",
    )
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    p.add_argument(
        "--rules", action="store_true", help="list the rules (id, severity, loaders) and exit"
    )


def cmd_inspect(args: argparse.Namespace) -> int:
    """Run ``exportlm inspect``; returns the exit code."""
    from exportlm.inspection import RULES, inspect_checkpoint

    if args.rules:
        if args.json:
            rules = [
                {
                    "id": r.id,
                    "severity": r.severity.value,
                    "loaders": list(r.loaders),
                    "applies_to": r.applies_to,
                    "summary": r.summary,
                    "reference": r.reference,
                }
                for r in RULES.values()
            ]
            print(json.dumps(rules, indent=2))
        else:
            rows = [
                (r.id, r.severity.value, ", ".join(r.loaders) or "-", r.summary)
                for r in RULES.values()
            ]
            print_table(("rule", "severity", "loaders", "requires"), rows)
        return EXIT_OK
    if args.path is None:
        raise UsageError(
            "inspect needs a PATH (a checkpoint directory or an .onnx file), or --rules"
        )
    try:
        report = inspect_checkpoint(args.path)
    except (InvalidInputError, NotRegularFileError) as err:
        raise UsageError(str(err)) from err
    except OSError as err:  # permission denied, I/O error: the path cannot be read
        raise UsageError(f"cannot read {err.filename or args.path}: {err.strerror or err}") from err
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return EXIT_OK if report.ok else EXIT_FAILURE
    summary = ", ".join(f"{k}={v}" for k, v in report.summary.items())
    print(f"{report.path} ({report.kind}): {summary}")
    if report.findings:
        rows = [(f.severity.value, f.rule, f.subject, f.message) for f in report.findings]
        print_table(("severity", "rule", "tensor / file", "message"), rows)
    counts = {
        s: len([f for f in report.findings if f.severity.value == s])
        for s in ("error", "warning", "info")
    }
    verdict = "FAIL" if counts["error"] else "OK"
    print(
        f"{verdict}: {counts['error']} error(s), {counts['warning']} warning(s), "
        f"{counts['info']} info; each rule is explained in docs/checkpoint-rules.md#<rule>"
    )
    return EXIT_OK if report.ok else EXIT_FAILURE
