"""A bare ``pytest --lf`` after a failed suite run: the suite's failed items from pytest's cache.

Read in ``pytest_configure``, before the cache provider sets ``config.cache`` up,
so the record is read from where that provider keeps it (``cache_dir``, default
``.pytest_cache``, ``v/cache/lastfailed``). Only a regular, small JSON file is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pytest_exportcheck.plan._nodeids import SuiteArgs, last_failed_args

__all__ = ["last_failed_suite_args"]

#: A larger record is not read (pytest's own lists every failed node id in it).
_MAX_BYTES = 16 * 1024 * 1024


def last_failed_suite_args(config: pytest.Config) -> SuiteArgs:
    """The suite's items pytest recorded as failed, under ``--lf``; empty otherwise."""
    if not getattr(config.option, "lf", False):
        return SuiteArgs()
    if not config.pluginmanager.has_plugin("cacheprovider"):
        return SuiteArgs()
    raw = os.path.expanduser(os.path.expandvars(str(config.getini("cache_dir"))))
    root = Path(raw) if os.path.isabs(raw) else config.rootpath / raw
    record = root / "v" / "cache" / "lastfailed"
    try:  # a regular file only (a FIFO would block); the stdlib keeps a passive run light
        if not record.is_file() or record.stat().st_size > _MAX_BYTES:
            return SuiteArgs()
        data = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # unreadable or not JSON: nothing to rerun
        return SuiteArgs()
    return last_failed_args(data)
