"""``progress.json``: a streaming export's progress record, signed and bound to its directory.

The record is JSON, written atomically after every part. It is stored as
``{"record": ..., "signature": ...}``; the signature is the HMAC, under this user's
signing key (:mod:`exportlm.export.trustkey`, the key that signs manifests), of the work
directory's name and the record's canonical JSON. So a record edited by hand, written by
another user or moved from another work directory does not verify, and is never acted on.

:func:`load_record` opens the file with :func:`exportlm.safeio.open_regular` (no link
followed, a FIFO or device refused before a byte is read) and reads at most
:data:`MAX_BYTES`. The file names the record holds must be :func:`plain_name` s: a name
inside the work directory, never a path.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from exportlm.atomic import write_text_atomic
from exportlm.errors import NotRegularFileError
from exportlm.export.trustkey import sign, verify_signature
from exportlm.safeio import open_regular

__all__ = ["MAX_BYTES", "PROGRESS", "load_record", "plain_name", "save_record"]

PROGRESS = "progress.json"
MAX_BYTES = 64 << 20
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
logger = logging.getLogger("exportlm.stream")


def plain_name(name: object) -> bool:
    """Whether ``name`` is a file name inside the work directory (no ``/``, no ``..``, no dot first)."""
    return isinstance(name, str) and _PLAIN.fullmatch(name) is not None and ".." not in name


def _payload(directory: Path, record: dict[str, Any]) -> bytes:
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return f"exportlm streaming progress {directory.name}\n{canonical}".encode()


def save_record(directory: Path, record: dict[str, Any]) -> None:
    """Write ``record`` and its signature (atomically: a kill leaves the old one or this)."""
    data = {"record": record, "signature": sign(_payload(directory, record))}
    write_text_atomic(directory / PROGRESS, json.dumps(data) + "\n")


def load_record(directory: Path) -> dict[str, Any] | None:
    """The record in ``directory`` when it is there, readable and signed by this user; else None."""
    path = directory / PROGRESS
    try:
        with open_regular(path, what="streaming progress record", nofollow=True) as handle:
            raw = handle.read(MAX_BYTES + 1)
        data = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except FileNotFoundError:
        return None
    except (OSError, NotRegularFileError, ValueError, RecursionError) as err:
        logger.warning("ignoring %s: %s", path, err)
        return None
    record = data.get("record") if isinstance(data, dict) else None
    signature = data.get("signature") if isinstance(data, dict) else None
    if not isinstance(record, dict) or not isinstance(signature, str):
        logger.warning("ignoring %s: not a progress record", path)
        return None
    if not verify_signature(_payload(directory, record), signature):
        logger.warning(
            "ignoring %s: its signature does not verify (changed outside the export, or "
            "written without this user's signing key)",
            path,
        )
        return None
    return record
