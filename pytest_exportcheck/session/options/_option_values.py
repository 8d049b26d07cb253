"""Parsers of single option values: each returns the typed value or raises ``pytest.UsageError``.

Kept apart from :mod:`pytest_exportcheck.session.options._options` (the option table and the
resolved :class:`~pytest_exportcheck.session.options._options.Options`) so that module stays a table.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest

from pytest_exportcheck.plan._selection import DEVICES

__all__ = [
    "UPDATE_SCOPES",
    "parse_catalogue",
    "parse_count",
    "parse_engines",
    "parse_devices",
    "parse_update_scope",
]

#: Values of ``--export-update-goldens``; the bare flag means the first.
UPDATE_SCOPES = ("own", "all")


def parse_update_scope(value: Any) -> str | None:
    """``--export-update-goldens`` as ``None`` (compare), ``"own"`` or ``"all"``."""
    text = str(value).strip().lower() if value is not None else ""
    if text in ("", "false", "0", "no"):
        return None
    if text in ("true", "1", "yes"):
        return UPDATE_SCOPES[0]
    if text not in UPDATE_SCOPES:
        raise pytest.UsageError(
            f"--export-update-goldens: unknown value {value!r}; expected 'own' (goldens of "
            "exporters your project provides; the default of the bare flag) or 'all'. A bare "
            "flag takes the next argument as its value: write `--export-update-goldens=own "
            f"{value}` if {value!r} is a path or another argument"
        )
    return text


def parse_engines(value: Any) -> tuple[str, ...]:
    """``--export-engine`` values (command line or ini lines) as ``NAME=PATH`` strings."""
    items = [str(v).strip() for v in (value or ()) if str(v).strip()]
    names: list[str] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise pytest.UsageError(f"--export-engine takes NAME=PATH, got {item!r}")
        if name.strip() in names:
            raise pytest.UsageError(f"--export-engine names engine {name.strip()!r} twice")
        if not os.path.isabs(os.path.expanduser(path.strip())):
            raise pytest.UsageError(
                f"--export-engine {item!r}: {path.strip()!r} is a relative path, which would be "
                "looked up in the current directory (whatever it holds); give the engine's "
                "interpreter or venv as an absolute path"
            )
        names.append(name.strip())
    return tuple(items)


def parse_count(value: Any, flag: str) -> int:
    """A non-negative integer option."""
    try:
        number = int(str(value if value is not None else 0).strip())
    except ValueError:
        number = -1
    if number < 0:
        raise pytest.UsageError(f"{flag}: expected a number of items >= 0, got {value!r}")
    return number


def parse_catalogue(value: Any) -> int | None:
    """The pinned catalogue version (a positive integer), or ``None`` when unpinned."""
    if value is None or str(value).strip().lower() in ("", "current", "latest"):
        return None
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise pytest.UsageError(
            f"exportcheck_catalogue / --export-catalogue: expected a catalogue version "
            f"(1, 2, ...) or 'current', got {value!r}"
        )
    return int(text)


def parse_devices(text: str) -> tuple[str, ...]:
    parts: Sequence[str] = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in DEVICES]
    if unknown or not parts:
        raise pytest.UsageError(
            f"--export-device: unknown device {', '.join(map(repr, unknown)) or repr(text)}; "
            f"expected one or more of {', '.join(DEVICES)} (comma-separated)"
        )
    return tuple(d for d in DEVICES if d in parts)
