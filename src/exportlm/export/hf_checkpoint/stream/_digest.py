"""The one digest the streaming export binds its resume state with (source files, work files).

A file's digest is the export's digest (BLAKE3, :mod:`exportlm.export._digest`) over its bytes, read in pieces of :data:`_PIECE` bytes into one
reused buffer (the memory is the buffer, whatever the file's size), from a descriptor
opened by :func:`exportlm.safeio.open_regular` (a FIFO, device or link is refused, never
read). It must be the digest :func:`~exportlm.export.hf_checkpoint.sink.write_safetensors`
returns for the files it writes (``FileDigest.digest``): a resumed run re-hashes each work
file and compares it with what the writer recorded. Both take the algorithm from
:data:`exportlm.export._digest.DIGEST`; the resume tests fail if they ever disagree.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import cast

from exportlm.export._digest import DIGEST, new_hasher
from exportlm.safeio import open_regular

__all__ = ["file_digest"]

_PIECE = 1 << 20


def file_digest(path: Path, *, what: str, follow: bool = False) -> str:
    """The hex digest (:data:`~exportlm.export._digest.DIGEST`) of the regular file ``path``.

    A symbolic link as the last component is refused unless ``follow`` (a model
    directory may be a hub snapshot, every file a link into ``blobs/``; a work file is
    never a link).

    Raises:
        NotRegularFileError: ``path`` is a FIFO, device, socket or directory.
        OSError: it is missing, unreadable, or a symbolic link and not ``follow``.
    """
    buffer = bytearray(_PIECE)
    view = memoryview(buffer)
    with open_regular(path, what=what, nofollow=not follow) as handle:
        digest = new_hasher(DIGEST, size=os.fstat(handle.fileno()).st_size)
        reader = cast(io.BufferedReader, handle)  # what open_regular opens
        while count := reader.readinto(view):
            digest.update(view[:count])
    return digest.hexdigest()
