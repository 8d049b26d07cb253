"""One artifact cache for the inner suite runs of this test session (pytester projects).

Each pytester project is a fresh directory, so its inner run would export every toy
artifact again. A test whose point is not the cache itself asks for ``suite_cache``:
its project's ``.pytest_cache/d/exportcheck/artifacts`` (where the plugin keeps its
cross-run artifacts) becomes a link to one directory shared by the whole session, so
the first run that needs an artifact exports it and every later one reads it.

Sharing is sound because an entry is keyed by everything that can change it (target,
kwargs, model fingerprint, the source of the target's and the model's packages,
library versions) and verified on read; cached files are read-only. Under xdist the
workers' base temporary directories are siblings, so the shared directory lies in
their parent; two workers that race on one key serialize on the cache's own lock
file. Only ``artifacts`` is shared: remembered export failures and pytest's own cache
(``--lf``, stepwise) stay the project's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

__all__ = ["shared_artifacts", "suite_cache"]

_SHARED = "exportcheck-shared-artifacts"


@pytest.fixture(scope="session")
def shared_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's artifact directory, one for every xdist worker of the run."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # <basetemp root>/popen-gwN: the workers' common parent
    root = base / _SHARED
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture
def suite_cache(pytester: pytest.Pytester, shared_artifacts: Path) -> Path:
    """Point the pytester project's artifact cache at the session's; returns the shared one."""
    link = pytester.path / ".pytest_cache" / "d" / "exportcheck" / "artifacts"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(shared_artifacts, target_is_directory=True)
    return shared_artifacts
