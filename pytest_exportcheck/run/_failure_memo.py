"""Exports whose exporter failed, remembered across runs next to the artifact cache.

A toy family that a target cannot export (an expected failure such as
``roundtrip_logits[onnx-llama4-cpu]``) otherwise costs the whole failing export
again on every run and on every xdist worker: torch.onnx takes tens of seconds to
give up on a graph it cannot convert. The artifact cache keys an export by
everything that can change it (target, kwargs, model fingerprint, the source of
the target's package, and the versions of every library the target's distribution
requires, :mod:`._versions`), so an export that failed under a key fails again
under it; upgrading a backend changes the key, and the failure is not replayed.
:class:`ExportFailureMemo` keeps the failure under that key in
``<pytest cache>/exportcheck/failures/<key>.json``, with those versions, and raises
it again as :class:`RememberedExportFailure`, a subclass of the original
:class:`~exportlm.errors.ExportFailedError`, with the original message and a note
naming the versions it was remembered with and ``--export-no-cache``.

Only :class:`~exportlm.errors.ExportFailedError` is remembered (the underlying
exporter failed on the graph), and only when nothing in its cause chain is a
``MemoryError`` or an ``OSError`` with an ``errno`` (a full disk or an exhausted
machine is not a property of the key; ``inspect.getsource``'s ``OSError`` for a
class TorchScript cannot read is). A record is data (type name and text), signed with this
user's HMAC key (:mod:`exportlm.export.trustkey`); an unsigned or changed record
is ignored. ``--export-no-cache`` (no cache directory) remembers nothing.

Two xdist workers that need the same export at once serialize on
:meth:`ExportFailureMemo.exclusive` (an ``fcntl`` lock per key), so the second
one reads what the first left: the published artifact, or the failure record. A
lock path that is not a private regular file (a planted link) is never opened
(:func:`exportlm.safeio.open_lock_file`): that key is neither recalled nor
remembered in this run, with an ``ExportCheckWarning``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exportlm.atomic import write_text_atomic
from exportlm.errors import ExportFailedError, UnsafeLockFileError
from exportlm.safeio import exclusive_lock
from pytest_exportcheck._warnings import ExportCheckWarning
from pytest_exportcheck.run._versions import Versions, describe_versions

__all__ = ["ExportFailureMemo", "RememberedExportFailure"]

logger = logging.getLogger(__name__)

#: Bump when the record changes. 2: the record carries the versions it failed with.
MEMO_FORMAT = 2


def _transient(err: BaseException) -> bool:
    """Whether ``err`` says something about the machine rather than the export."""
    return isinstance(err, MemoryError) or (isinstance(err, OSError) and err.errno is not None)


class RememberedExportFailure(ExportFailedError):
    """An export that failed in an earlier run under the same cache key, raised again."""


def _canonical(record: dict[str, Any]) -> bytes:
    body = {k: v for k, v in record.items() if k != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not s for s in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


class ExportFailureMemo:
    """Failed exports by cache key; ``root=None`` remembers nothing."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        #: Failures raised again from a record in this session.
        self.recalled = 0
        #: Keys whose lock path was unsafe: neither recalled nor remembered.
        self._unsafe: set[str] = set()

    def _path(self, key: str) -> Path | None:
        if self.root is None or key in self._unsafe:
            return None
        return self.root / f"{key}.json"

    @contextlib.contextmanager
    def exclusive(self, key: str) -> Iterator[None]:
        """Hold the inter-process lock of ``key`` (no-op without a root or ``fcntl``)."""
        if self.root is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(exclusive_lock(self.root / f"{key}.lock"))
            except UnsafeLockFileError as err:
                self._unsafe.add(key)
                warnings.warn(
                    ExportCheckWarning(
                        f"failure memo: {err} Failures of this export are neither replayed "
                        "nor remembered in this run; it is not a failure of the target."
                    ),
                    stacklevel=3,
                )
            yield

    def recall(self, key: str) -> RememberedExportFailure | None:
        """The failure remembered under ``key``, or ``None``."""
        from exportlm.export import trustkey

        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("format") != MEMO_FORMAT:
            return None
        if record.get("key") != key or not trustkey.verify_signature(
            _canonical(record), record.get("hmac")
        ):
            logger.info("ignoring the failure record %s: not signed here or changed", path)
            return None
        self.recalled += 1
        failure = RememberedExportFailure(str(record.get("message", "")))
        failure.add_note(
            f"exportcheck: remembered from a run with {_described(record.get('versions'))} "
            f"(in {path}): this export failed then under the same cache key (target, options, "
            "model, the target's source and those library versions), so it is not run again. "
            "Upgrading any of those libraries runs it again; so does --export-no-cache."
        )
        return failure

    def remember(self, key: str, err: BaseException, versions: Versions = ()) -> None:
        """Keep ``err`` under ``key`` if it is a failure of the exporter itself.

        ``versions``: what the key was computed from (:func:`._versions.export_versions`),
        kept for the message of a replay.
        """
        from exportlm.export import trustkey

        path = self._path(key)
        if path is None or not isinstance(err, ExportFailedError):
            return
        if isinstance(err, RememberedExportFailure):
            return
        if any(_transient(e) for e in _chain(err)):
            return
        record: dict[str, Any] = {
            "format": MEMO_FORMAT,
            "key": key,
            "message": str(err),
            "versions": [list(pair) for pair in versions],
        }
        signature = trustkey.sign(_canonical(record))
        if signature is None:
            return
        record["hmac"] = signature
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(record, indent=1, sort_keys=True))
        except OSError as write_error:  # a read-only cache: remember nothing
            logger.info("could not remember the failed export in %s: %s", path, write_error)


def _described(versions: Any) -> str:
    """The versions of a record, readable; a record's own data, so checked for shape."""
    if not isinstance(versions, list) or not versions:
        return "the library versions of its cache key"
    pairs = tuple(
        (str(p[0]), None if p[1] is None else str(p[1]))
        for p in versions
        if isinstance(p, list) and len(p) == 2
    )
    return describe_versions(pairs)
