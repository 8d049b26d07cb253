"""The golden store of a run: where goldens live, and which ones an update may write.

``--export-goldens-dir`` (default ``goldens/`` under rootdir) holds the run's
goldens; goldens missing there are read from the package's own (built-in
exporters), then from those installed exporters ship (``ModuleExporter.goldens``). ``--export-update-goldens`` writes only goldens of exporters that the
project under test (``[project].name`` of its ``pyproject.toml``) provides, unless
``=all``: a local copy of another distribution's golden would shadow the one it
ships and hide its regressions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pytest_exportcheck.session.options._options import Options

__all__ = ["golden_store", "goldens_dir", "read_project_name"]


def goldens_dir(config: pytest.Config, options: Options) -> Path:
    """``--export-goldens-dir``, else ``goldens/`` under rootdir."""
    if options.goldens_dir is not None:
        return options.goldens_dir
    return config.rootpath / "goldens"


def golden_store(config: pytest.Config, options: Options, shipped: Sequence[Path] = ()) -> Any:
    """The :class:`~pytest_exportcheck.goldens.GoldenStore` handed to every case.

    ``shipped``: the goldens directories installed exporters ship
    (``ModuleExporter.goldens``), read after the package's own.
    """
    from pytest_exportcheck.goldens import BUILTIN_GOLDENS, GoldenStore

    own = read_project_name(config.rootpath)
    scope = options.update_goldens

    def may_update(owner: str | None) -> str | None:
        """Why ``--export-update-goldens`` must not write a golden of ``owner``'s, or ``None``."""
        if scope == "all" or owner is None:
            return None
        if own is not None and _normalize(own) == _normalize(owner):
            return None
        project = f"this project ({own})" if own else "this project (no [project] name)"
        return (
            f"it describes an exporter that {owner} provides, not {project}; a local copy "
            f"would shadow the golden {owner} ships and hide its regressions. Pass "
            "--export-update-goldens=all to write one anyway"
        )

    return GoldenStore(
        goldens_dir(config, options),
        update=scope is not None,
        fallbacks=(BUILTIN_GOLDENS, *shipped),
        may_update=may_update,
    )


def read_project_name(root: Path) -> str | None:
    """``[project].name`` of ``root/pyproject.toml``, or ``None`` (absent or unreadable).

    A ``pyproject.toml`` that is not a regular file (a FIFO would block) counts as
    unreadable, like a missing one.
    """
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10 has no tomllib: no name known
        return None
    from exportlm.safeio import read_regular_text

    try:
        data = tomllib.loads(read_regular_text(root / "pyproject.toml", what="pyproject.toml"))
    except (OSError, ValueError):  # NotRegularFileError, UnicodeDecodeError, TOMLDecodeError
        return None
    name = data.get("project", {}).get("name")
    return str(name) if name else None


def _normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it (``Acme_Plugin`` == ``acme-plugin``)."""
    return re.sub(r"[-_.]+", "-", name).lower()
