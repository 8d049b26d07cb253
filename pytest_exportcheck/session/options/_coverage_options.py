"""The coverage options read back: ``--export-strict``, ``--export-lock`` and ``--export-shard``.

Declared in the one option table (:mod:`._option_specs`). Each has an ini key of the
same name (``export_strict``, ``export_lock``, ``export_shard``); the command line wins. ``--export-strict`` is on by default
when the environment variable ``CI`` is set (to anything but ``0`` / ``false``
/ ``no``). Imports only pytest and the plan package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest

from pytest_exportcheck.plan._shard import Shard

__all__ = ["LOCK_MODES", "coverage_options"]

#: ``--export-lock``: compare with the lockfile when present, rewrite it, or ignore it.
LOCK_MODES = ("check", "update", "off")
_ON = ("on", "true", "1", "yes")
_OFF = ("off", "false", "0", "no")


def _raw(config: pytest.Config, name: str) -> str:
    value = config.getoption(name)
    if value is None:
        value = config.getini(name)
    return str(value or "").strip().lower()


def _strict(text: str, env: Mapping[str, str]) -> bool:
    if not text:
        ci = env.get("CI", "").strip().lower()
        return bool(ci) and ci not in _OFF
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise pytest.UsageError(
        f"--export-strict: expected on or off, got {text!r}; a bare flag takes the next "
        f"argument as its value: write `--export-strict=on {text}` if {text!r} is a path"
    )


def _strict_allow(config: pytest.Config) -> tuple[tuple[str, str], ...]:
    """``(row, reason)`` pairs of ``--export-strict-allow`` and the ini lines (``ROW reason``)."""
    given = config.getoption("export_strict_allow")
    lines = list(given) if given else list(config.getini("export_strict_allow"))
    allowed: dict[str, str] = {}
    for line in (str(line).strip() for line in lines):
        row, _, reason = line.partition(" ")
        if not row:
            continue
        allowed[row] = reason.strip() or "no reason given"
    return tuple(allowed.items())


def coverage_options(config: pytest.Config) -> dict[str, Any]:
    """``strict``, ``lock`` and ``shard`` of :class:`~._options.Options` (bad values: usage errors)."""
    lock = _raw(config, "export_lock") or LOCK_MODES[0]
    if lock not in LOCK_MODES:
        raise pytest.UsageError(
            f"--export-lock: expected one of {', '.join(LOCK_MODES)}, got {lock!r}"
        )
    shard_text = _raw(config, "export_shard")
    try:
        shard = Shard.parse(shard_text) if shard_text else None
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    return {
        "strict": _strict(_raw(config, "export_strict"), os.environ),
        "strict_allow": _strict_allow(config),
        "lock": lock,
        "shard": shard,
    }
