"""Check that the installed exportlm is a wheel's copy that carries every golden.

Run by ``make test-wheel`` with the interpreter of ``.venv-wheel``, from an empty
directory and without ``PYTHONPATH``, with ``git ls-files goldens`` on stdin (the
goldens of the checkout, ``goldens/<kind>/...json``). Prints where ``exportlm`` and
``pytest_exportcheck`` were imported from; exits 1 when either comes from outside
this interpreter's environment or when the shipped goldens
(``pytest_exportcheck/_goldens``) differ from the checkout's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import exportlm
import pytest_exportcheck


def _outside_environment() -> list[str]:
    prefix = Path(sys.prefix).resolve()
    problems = []
    for module in (exportlm, pytest_exportcheck):
        where = Path(module.__file__ or "").resolve()
        print(f"wheel: {module.__name__} {where}")
        if not where.is_relative_to(prefix) or "site-packages" not in where.parts:
            problems.append(f"{module.__name__} is imported from {where}, not from {prefix}")
    return problems


def _golden_differences(listed: set[str]) -> list[str]:
    shipped_root = Path(pytest_exportcheck.__file__ or "").parent / "_goldens"
    shipped = {
        "goldens/" + path.relative_to(shipped_root).as_posix()
        for path in shipped_root.rglob("*.json")
    }
    print(f"wheel: {len(shipped)} golden JSON file(s) shipped, {len(listed)} in the checkout")
    return [f"missing from the wheel: {name}" for name in sorted(listed - shipped)] + [
        f"in the wheel but not in git: {name}" for name in sorted(shipped - listed)
    ]


def main() -> int:
    listed = {line.strip() for line in sys.stdin if line.strip().endswith(".json")}
    problems = _outside_environment()
    if not listed:
        problems.append("no goldens on stdin (expected `git ls-files goldens`)")
    problems += _golden_differences(listed)
    for problem in problems:
        print(f"wheel: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
