"""The signing key of one run: this user's, or a temporary one when this user's is unusable.

A code-executing target's artifact (``.pt``, ``.pt2``) loads without ``trust=True``
only when its manifest is signed with this user's key (``docs/security.md``). When
that key is unusable (empty, of the wrong size, readable by others, a symbolic
link, a directory, not creatable), every manifest is written unsigned, and every
check that loads such an artifact used to fail the conforming target with
``UntrustedArtifactError``: the suite blamed the target for the key.

Instead, the run asks :func:`exportlm.export.trustkey.key_problem` once, in the
controller. When the key is unusable, the run signs with a key of its own: 32
random bytes in a new private directory (``0700``, the file ``0600``), named by
``EXPORTLM_KEY_FILE`` for the run's duration (xdist workers get it in their
``workerinput``) and removed at its end. Every check still proves that what it
loads was exported by this run, and nothing vouches for anything afterwards. The
cross-run artifact cache and failure memo are off for such a run (their entries
are signed with the user's key, which cannot be checked). The problem is reported
once, in the terminal summary, with what to do; no item fails because of it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

__all__ = ["RunSigningKey"]

_WORKER_INPUT = "exportcheck_signing_key"


class RunSigningKey:
    """The key of this run (see the module docstring); registered as a plugin for its hook."""

    def __init__(self, config: pytest.Config) -> None:
        from exportlm.export.trustkey import KEY_FILE_ENV, key_problem

        self._env = KEY_FILE_ENV
        self._saved = os.environ.get(KEY_FILE_ENV)
        self._own: Path | None = None
        given = getattr(config, "workerinput", {}).get(_WORKER_INPUT)
        if given is not None:  # an xdist worker: the controller decided
            self.problem: str | None = given["problem"]
            os.environ[KEY_FILE_ENV] = given["path"]
            return
        self.problem = key_problem()
        if self.problem is not None:
            self._own = Path(tempfile.mkdtemp(prefix="exportcheck-key-"))  # 0700
            key = self._own / "key"
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(secrets.token_bytes(32))
            os.environ[KEY_FILE_ENV] = str(key)

    @property
    def temporary(self) -> bool:
        """Whether this run signs with a key of its own (the cross-run cache is then off)."""
        return self.problem is not None

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """xdist (controller): hand a worker the run's key, when the run has its own."""
        if self.problem is not None:
            node.workerinput[_WORKER_INPUT] = {
                "problem": self.problem,
                "path": os.environ[self._env],
            }

    def summary_line(self) -> str | None:
        """The one line that reports an unusable key, or ``None``."""
        if self.problem is None:
            return None
        return (
            f"exportcheck: {self.problem} This run signed its exports with a temporary key of "
            "its own (removed at its end) and used no cross-run artifact cache; no target was "
            "failed for the key."
        )

    def close(self) -> None:
        """Give ``EXPORTLM_KEY_FILE`` back its value and remove the run's own key."""
        if self.problem is None:
            return
        if self._saved is None:
            os.environ.pop(self._env, None)
        else:
            os.environ[self._env] = self._saved
        if self._own is not None:
            shutil.rmtree(self._own, ignore_errors=True)
            self._own = None
