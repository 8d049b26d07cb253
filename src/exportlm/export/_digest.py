"""The one digest of artifact files: BLAKE3 (manifest schema 3), sha256 still read (schema 2).

Every file a manifest lists carries a cryptographic digest that is checked on every load.
Since manifest schema 3 that digest is BLAKE3 (the ``blake3`` package, the BLAKE3 team's
binding of the reference implementation): 4-5x the speed of sha256 on one core and
multithreaded for large inputs, so hashing as the export writes keeps up with the disk.
Schema 1 and 2 manifests list sha256 digests; they are verified with sha256.

Everything that hashes an artifact file uses this module: :func:`file_digest` (a file
by path), :func:`hash_handle` (an open file, optionally copying what it reads),
:func:`digest_bytes` and :func:`new_hasher` (bytes as they are written). Torch-free.
"""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO, Protocol

import blake3

from exportlm.safeio import open_regular

__all__ = [
    "DIGEST",
    "LEGACY_DIGEST",
    "THREADED_FROM",
    "Hasher",
    "digest_bytes",
    "file_digest",
    "hash_handle",
    "new_hasher",
]

#: The manifest's file digest (schema 3): the key of every file entry.
DIGEST = "blake3"
#: The digest of schema 1 and 2 manifests, still verified.
LEGACY_DIGEST = "sha256"
#: From this many bytes a BLAKE3 hasher uses several threads (``max_threads=AUTO``).
THREADED_FROM = 64 << 20
_CHUNK = 8 << 20


class Hasher(Protocol):
    """What :func:`new_hasher` returns: ``update`` with bytes in order, then ``hexdigest``."""

    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str = DIGEST, *, size: int = 0) -> Hasher:
    """A fresh hasher of ``algorithm``; ``size`` (the bytes it will see, when known) from
    :data:`THREADED_FROM` up makes a BLAKE3 one hash each large update on several threads.

    Raises:
        ValueError: an algorithm other than :data:`DIGEST` and :data:`LEGACY_DIGEST`.
    """
    if algorithm == DIGEST:
        threads = blake3.blake3.AUTO if size >= THREADED_FROM else 1
        return blake3.blake3(max_threads=threads)
    if algorithm == LEGACY_DIGEST:
        return hashlib.sha256()
    raise ValueError(f"unknown digest {algorithm!r}; expected {DIGEST!r} or {LEGACY_DIGEST!r}")


def digest_bytes(data: bytes | memoryview, algorithm: str = DIGEST) -> str:
    """Hex digest of ``data``."""
    hasher = new_hasher(algorithm, size=len(data))
    hasher.update(data)
    return hasher.hexdigest()


def hash_handle(
    handle: BinaryIO, copy_to: BinaryIO | None = None, algorithm: str = DIGEST
) -> tuple[str, int]:
    """(hex digest, size) of ``handle`` from its start; every chunk also goes to ``copy_to``."""
    try:
        expected = os.fstat(handle.fileno()).st_size
    except (OSError, AttributeError, ValueError):
        expected = 0
    hasher = new_hasher(algorithm, size=expected)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    size = 0
    handle.seek(0)
    while read := handle.readinto(view):  # type: ignore[attr-defined]
        hasher.update(view[:read])
        size += read
        if copy_to is not None:
            copy_to.write(view[:read])
    return hasher.hexdigest(), size


def file_digest(path: str | os.PathLike[str], algorithm: str = DIGEST) -> str:
    """Hex digest (BLAKE3 by default) of the regular file at ``path``.

    Raises:
        NotRegularFileError: a FIFO, device or directory is at ``path`` (nothing is read).
        FileNotFoundError: nothing is at ``path``.
    """
    with open_regular(path, what="artifact file") as handle:
        return hash_handle(handle, algorithm=algorithm)[0]
