"""A bare ``pytest --lf`` or ``--sw`` after a failed suite run: the suite's failed items.

Read in ``pytest_configure``, before the cache provider sets ``config.cache`` up,
so the records are read from where that provider keeps them (``cache_dir``,
default ``.pytest_cache``, ``v/cache/lastfailed`` and ``v/cache/stepwise``). Only
regular, small JSON files are read.

``--lf`` plans every suite item pytest recorded as failed. ``--sw`` (and
``--sw-skip``) plans those too, plus the one stepwise recorded as where it stopped:
pytest's stepwise plugin then starts at that item, so the rerun goes through the
suite's failures in plan order, stopping at the first that still fails.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pytest_exportcheck.plan._nodeids import SuiteArgs, item_id_of, last_failed_args

__all__ = ["last_failed_suite_args"]

#: A larger record is not read (pytest's own lists every failed node id in it).
_MAX_BYTES = 16 * 1024 * 1024


def last_failed_suite_args(config: pytest.Config) -> SuiteArgs:
    """The suite's items pytest recorded as failed, under ``--lf`` or ``--sw``; empty otherwise."""
    option = config.option
    stepwise = bool(getattr(option, "stepwise", False) or getattr(option, "stepwise_skip", False))
    if not (getattr(option, "lf", False) or stepwise):
        return SuiteArgs()
    if not config.pluginmanager.has_plugin("cacheprovider"):
        return SuiteArgs()
    raw = os.path.expanduser(os.path.expandvars(str(config.getini("cache_dir"))))
    root = Path(raw) if os.path.isabs(raw) else config.rootpath / raw
    args = last_failed_args(_read(root / "v" / "cache" / "lastfailed"))
    if not stepwise:
        return args
    stopped = _stepwise_nodeid(_read(root / "v" / "cache" / "stepwise"))
    item = item_id_of(stopped) if stopped else None
    if item is None or item in args.item_ids:
        return args
    return replace(args, items=(*args.items, (item, stopped)), lenient=True)


def _read(record: Path) -> Any:
    """The JSON of a regular file of at most ``_MAX_BYTES``; ``None`` otherwise."""
    try:  # a regular file only (a FIFO would block); the stdlib keeps a passive run light
        if not record.is_file() or record.stat().st_size > _MAX_BYTES:
            return None
        return json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # unreadable or not JSON: nothing to rerun
        return None


def _stepwise_nodeid(data: Any) -> str:
    """The node id stepwise stopped at: pytest < 8.4 stores the id, later a dict with it."""
    if isinstance(data, dict):
        data = data.get("last_failed")
    return data if isinstance(data, str) else ""
