"""One export per (target, family, seed, options) for the whole test session.

Several test files read the same artifact (a ``kv_cache=True`` ONNX export of the
toy decoder, say) and only read it: :func:`shared_export` exports it once per
session, across xdist workers, into a directory every worker of the session sees,
under a file lock, and hands out the path of a read-only file. Each caller gets its
own model, built with the same family and seed as the exported one (seeded models
are equal across processes), to compare the artifact against.

Tests that mutate an artifact, test atomicity or failures, or test that the export
leaves its model unchanged keep their own export in ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import exportlm
from exportlm.models import build_model

SUFFIX = {"onnx": ".onnx", "torchscript": ".pt", "torch_export": ".pt2"}
_DONE = "done.json"


@dataclass(frozen=True)
class SharedExport:
    """A freshly built model of the family and the read-only artifact exported from its twin."""

    target: str
    model: Any  # an nn.Module; Any as build_model's families carry a ``config``
    path: Path

    def load(self) -> Any:
        """The artifact's runtime (``exportlm.load_exported``)."""
        return exportlm.load_exported(self.target, self.path)


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory every xdist worker of this session shares (this run's own, alone)."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's basetemp is ``pytest-N/popen-gwK``: ``pytest-N`` is the
    # session's. Without xdist the parent is shared by every past run: use basetemp itself.
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-exports"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def shared_export(
    tmp_path_factory: pytest.TempPathFactory,
    target: str,
    family: str,
    seed: int = 0,
    *,
    filename: str | None = None,
    **options: Any,
) -> SharedExport:
    """``build_model(family, seed)`` exported to ``target`` with ``options``, once a session.

    ``filename`` names the artifact in its own folder (``model.onnx`` for the Optimum and
    genai folders, whose readers look for that name); default ``<family><suffix>``.
    """
    filename = filename or f"{family}{SUFFIX[target]}"
    spec = json.dumps([target, family, seed, filename, sorted(options.items())], default=repr)
    key = f"{target}-{family}-{seed}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    root = session_root(tmp_path_factory)
    folder = root / key
    path = folder / filename
    with _locked(root / f"{key}.lock"):
        if not (folder / _DONE).is_file():
            shutil.rmtree(folder, ignore_errors=True)  # what an interrupted export left
            exportlm.export_model(target, build_model(family, seed=seed), path, **options)
            for file in folder.rglob("*"):
                if file.is_file():
                    file.chmod(0o444)  # read-only: a test that writes to it fails loudly
            (folder / _DONE).write_text(spec, encoding="utf-8")
    return SharedExport(target, build_model(family, seed=seed), path)
