"""Load what was verified: each file opened once, hashed from that descriptor, read by the loader.

Someone who can write beside an artifact (a shared directory) can exchange the path
between a check and a load (``renameat2(RENAME_EXCHANGE)``), and someone who owns the
file a path names can rewrite it after it was hashed. So nothing here hashes a path
and lets a loader open it again:

* :func:`hold` opens the file once (:func:`~exportlm.safeio.open_regular`: a FIFO,
  device or directory is refused before a byte is read) and hashes it from that
  descriptor. When only this user (or root) can write the inode, the loader reads
  that same descriptor: renaming the path afterwards changes nothing it reads. When
  someone else could write it (another user's file, or one writable by group or
  others), its bytes are copied into an anonymous private temporary file *as they are
  hashed*, and the loader reads the copy: the hashed bytes are the loaded bytes.
* :func:`serving` makes held files what :func:`open_artifact` returns while
  :func:`~exportlm.export.load_exported` runs the loader. A loader opens its artifact
  with :func:`open_artifact`, never by path (the built-in torch runtimes do).

Torch-free.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

from exportlm.errors import ArtifactIntegrityError, NotRegularFileError
from exportlm.export._digest import DIGEST, LEGACY_DIGEST, file_digest, hash_handle
from exportlm.safeio import open_regular

__all__ = [
    "VerifiedFile",
    "check_entry",
    "file_digest",
    "file_sha256",
    "hash_handle",
    "hold",
    "open_artifact",
    "serving",
    "verify_listed",
]

_HELD: contextvars.ContextVar[Mapping[str, VerifiedFile] | None] = contextvars.ContextVar(
    "exportlm_verified_files", default=None
)
#: Paths whose held file :func:`open_artifact` handed out, per :func:`serving` context.
_SERVED: contextvars.ContextVar[set[Path] | None] = contextvars.ContextVar(
    "exportlm_served_files", default=None
)


@dataclass(frozen=True)
class VerifiedFile:
    """One artifact file, open, with the digest and size of exactly the bytes it reads.

    Attributes:
        path: the path it was opened from (informative: it is never opened again).
        handle: the open file the loader reads (the original descriptor, or a private copy).
        digest, size: of the bytes behind ``handle`` (hex ``algorithm`` digest, bytes).
        copied: whether ``handle`` is a private copy (the original was writable by others).
        algorithm: ``"blake3"`` (manifest schema 3) or ``"sha256"`` (schema 1-2).
    """

    path: Path
    handle: BinaryIO
    digest: str
    size: int
    copied: bool
    algorithm: str = DIGEST


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of the regular file at ``path`` (the digest of schema 1-2 manifests)."""
    return file_digest(path, LEGACY_DIGEST)


def _only_we_can_write(handle: BinaryIO) -> bool:
    """Whether nobody but this user (or root) can change the bytes of ``handle``'s inode."""
    if os.name != "posix":
        return False  # no uid/mode to rely on: always copy
    info = os.fstat(handle.fileno())
    writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    return info.st_uid in (os.getuid(), 0) and not writable_by_others


def hold(
    path: Path, *, what: str, copy_if_shared: bool = True, algorithm: str = DIGEST
) -> VerifiedFile:
    """Open ``path`` once and hash it (see the module docstring); the caller closes ``handle``.

    ``algorithm``: the digest its manifest lists (:mod:`~exportlm.export._digest`).
    ``copy_if_shared=False`` never makes the private copy (for a format that runs no code,
    whose loader resolves its own paths: the copy would buy nothing).

    Raises:
        NotRegularFileError: ``path`` is a FIFO, device, socket or directory.
        FileNotFoundError: nothing is at ``path``.
    """
    source = open_regular(path, what=what)
    try:
        if not copy_if_shared or _only_we_can_write(source):
            digest, size = hash_handle(source, algorithm=algorithm)
            return VerifiedFile(path, source, digest, size, False, algorithm)
        # mode 0600, and without a name at all where O_TMPFILE exists
        copy = cast(BinaryIO, tempfile.TemporaryFile(prefix="exportlm-verified-"))  # noqa: SIM115
        try:
            digest, size = hash_handle(source, copy_to=copy, algorithm=algorithm)
            copy.flush()
        except BaseException:
            copy.close()
            raise
        source.close()
        return VerifiedFile(path, copy, digest, size, True, algorithm)
    except BaseException:
        source.close()
        raise


@contextlib.contextmanager
def serving(files: Iterable[VerifiedFile]) -> Iterator[set[Path]]:
    """Make ``files`` what :func:`open_artifact` returns for their paths; closes them at the end.

    Yields the set of their paths that :func:`open_artifact` has handed out so far.
    """
    held = list(files)
    served: set[Path] = set()
    token = _HELD.set({**(_HELD.get() or {}), **{os.path.abspath(f.path): f for f in held}})
    served_token = _SERVED.set(served)
    try:
        yield served
    finally:
        _SERVED.reset(served_token)
        _HELD.reset(token)
        for file in held:
            file.handle.close()


def open_artifact(path: str | os.PathLike[str], *, what: str = "artifact") -> BinaryIO:
    """Open an artifact file for a runtime loader: the verified bytes, when there are some.

    Inside :func:`~exportlm.export.load_exported` this returns a new handle (positioned
    at 0) on the descriptor that was hashed, so the loader reads exactly the verified
    bytes, whatever the path names by now. Called outside it (a loader called directly),
    it opens ``path`` like :func:`~exportlm.safeio.open_regular`: nothing was verified.
    Read one returned handle at a time (they share the file position).
    """
    held = (_HELD.get() or {}).get(os.path.abspath(path))
    if held is None:
        return open_regular(path, what=what)
    served = _SERVED.get()
    if served is not None:
        served.add(held.path)
    fd = os.dup(held.handle.fileno())
    handle = io.open(fd, "rb", closefd=True)  # noqa: UP020, SIM115 - a descriptor, returned
    handle.seek(0)
    return handle


def check_entry(
    file: Path, entry: Any, actual: tuple[str, int, str], digest: str, manifest: Path
) -> None:
    """``actual`` (hex digest, size, its algorithm) must be a manifest ``entry``'s, whose
    file digests are ``digest``; else :class:`ArtifactIntegrityError` naming ``file``."""
    listed = (entry.get(digest), entry.get("size")) if isinstance(entry, Mapping) else None
    if actual[2] != digest or listed != actual[:2]:
        raise ArtifactIntegrityError(
            f"{file} does not match its {digest} digest in the manifest {manifest}: it was "
            "changed or replaced after export. It is not loaded; re-export the artifact from "
            "its model.",
            file,
        )


def verify_listed(root: Path, name: str, entry: Any, digest: str, manifest: Path) -> None:
    """Hash the file ``name`` the manifest lists under ``root`` and check it (see :func:`check_entry`).

    Raises:
        ArtifactIntegrityError: ``name`` leaves ``root``, the entry is malformed, the
            file is missing or not a regular file, or it differs.
    """
    candidate = (root / name).resolve()
    if not isinstance(entry, Mapping) or not candidate.is_relative_to(root.resolve()):
        raise ArtifactIntegrityError(
            f"manifest {manifest} lists {name!r}, which is not a file inside {root}; the "
            "manifest is malformed or tampered with. Re-export the artifact.",
            root / name,
        )
    file = root / name
    try:
        with open_regular(file, what="artifact file") as handle:
            found = hash_handle(handle, algorithm=digest)
    except (FileNotFoundError, NotRegularFileError) as err:
        raise ArtifactIntegrityError(
            f"{file} is listed in the manifest {manifest} but missing (or not a regular file); "
            "the artifact is incomplete. Re-export it.",
            file,
        ) from err
    check_entry(file, entry, (*found, digest), digest, manifest)
