"""Exports whose exporter failed, remembered across runs next to the artifact cache.

A toy family that a target cannot export (an expected failure such as
``roundtrip_logits[onnx-llama4-cpu]``) otherwise costs the whole failing export
again on every run and on every xdist worker: torch.onnx takes tens of seconds to
give up on a graph it cannot convert. The artifact cache keys an export by
everything that can change it (target, kwargs, model fingerprint, the source of
the target's package, library versions), so an export that failed under a key
fails again under it. :class:`ExportFailureMemo` keeps the failure under that key
in ``<pytest cache>/exportcheck/failures/<key>.json`` and raises it again as
:class:`RememberedExportFailure`, a subclass of the original
:class:`~exportlm.errors.ExportFailedError`, with the original message.

Only :class:`~exportlm.errors.ExportFailedError` is remembered (the underlying
exporter failed on the graph), and only when nothing in its cause chain is a
``MemoryError`` or an ``OSError`` with an ``errno`` (a full disk or an exhausted
machine is not a property of the key; ``inspect.getsource``'s ``OSError`` for a
class TorchScript cannot read is). A record is data (type name and text), signed with this
user's HMAC key (:mod:`exportlm.export.trustkey`); an unsigned or changed record
is ignored. ``--export-no-cache`` (no cache directory) remembers nothing.

Two xdist workers that need the same export at once serialize on
:meth:`ExportFailureMemo.exclusive` (an ``fcntl`` lock per key), so the second
one reads what the first left: the published artifact, or the failure record.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exportlm.atomic import write_text_atomic
from exportlm.errors import ExportFailedError

__all__ = ["ExportFailureMemo", "RememberedExportFailure"]

logger = logging.getLogger(__name__)

#: Bump when the record changes.
MEMO_FORMAT = 1


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

    def _path(self, key: str) -> Path | None:
        return None if self.root is None else self.root / f"{key}.json"

    @contextlib.contextmanager
    def exclusive(self, key: str) -> Iterator[None]:
        """Hold the inter-process lock of ``key`` (no-op without a root or ``fcntl``)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: both workers export
            yield
            return
        if self.root is None:
            yield
            return
        with open(self.root / f"{key}.lock", "a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

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
            f"exportcheck: this export failed in an earlier run under the same cache key "
            f"(remembered in {path}); --export-no-cache runs it again"
        )
        return failure

    def remember(self, key: str, err: BaseException) -> None:
        """Keep ``err`` under ``key`` if it is a failure of the exporter itself."""
        from exportlm.export import trustkey

        path = self._path(key)
        if path is None or not isinstance(err, ExportFailedError):
            return
        if isinstance(err, RememberedExportFailure):
            return
        if any(_transient(e) for e in _chain(err)):
            return
        record: dict[str, Any] = {"format": MEMO_FORMAT, "key": key, "message": str(err)}
        signature = trustkey.sign(_canonical(record))
        if signature is None:
            return
        record["hmac"] = signature
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(record, indent=1, sort_keys=True))
        except OSError as write_error:  # a read-only cache: remember nothing
            logger.info("could not remember the failed export in %s: %s", path, write_error)
