"""Empty directories for the suite's cases and its in-session artifact cache."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest

__all__ = ["Scratch"]


class Scratch:
    """Empty directories for the cases and the in-session artifact cache.

    They come from the session's ``TempPathFactory`` (so ``--basetemp`` and the
    retention of ``tmp_path_retention_count`` / ``_policy`` apply), which pytest
    keeps as ``config._tmp_path_factory``. pytest has no public way for a plugin
    to reach it: only tests get it, through the ``tmp_path_factory`` fixture, and
    these items are not fixture-using functions (a ``pytest.Function`` named
    ``check[params]`` without a parametrization gets a node id that pytest 9 does
    not match with the one it reads back for --lf / --sw), and constructing one
    (``TempPathFactory.from_config``) is private too. pytest-xdist reads the same
    attribute. Without it (``-p no:tmpdir``) a temporary directory of our own is
    used and removed at the end of the run.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._own: Path | None = None

    def mktemp(self, name: str) -> Path:
        """A new empty directory named after ``name``."""
        base = re.sub(r"\W", "_", name)[:40]
        factory = getattr(self.config, "_tmp_path_factory", None)  # set by pytest_configure
        if isinstance(factory, pytest.TempPathFactory):
            return factory.mktemp(base, numbered=True)
        if self._own is None:
            self._own = Path(tempfile.mkdtemp(prefix="exportcheck-"))
        return Path(tempfile.mkdtemp(prefix=f"{base}-", dir=self._own))

    def close(self) -> None:
        """Remove the directory of our own, if one was made."""
        if self._own is not None:
            shutil.rmtree(self._own, ignore_errors=True)
            self._own = None
