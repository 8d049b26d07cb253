"""Private work directories of streaming exports: created by one run, locked while it lives.

A streaming export of ``out/`` works in ``.out.stream-XXXXXXXX/`` beside it (same
filesystem, so finished shards reach the checkpoint by hard link). The directory is made
by ``mkdtemp`` (``mkdir`` with a random name: it cannot exist before, mode ``0700``) and
holds ``lock``, created with ``O_EXCL | O_NOFOLLOW``, on which the run keeps an exclusive
``flock`` until it publishes or dies (the kernel releases it even on SIGKILL). ``lock``
also holds the directory's *owner token*: the HMAC, under this user's signing key
(:mod:`exportlm.export.trustkey`), of the directory's name.

:func:`leftovers` yields the work directories a later run may continue or clear: those
this user's exportlm provably made (a real directory, not a link, owned by this user, mode
``0700``, its token valid) and whose run is dead (the lock is free; it is then held by the
caller). Anything else with that name pattern (a planted directory, a link, another
user's, a live run's) is left alone: never read beyond its lock, followed, deleted or
published. Nothing else in the output's directory is touched either, so a planted
``.out.stream`` or ``.out.*.tmp`` costs a later export nothing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from exportlm.export.trustkey import sign, verify_signature

__all__ = ["WorkDirectory", "create", "leftovers"]

_LOCK = "lock"
_RANDOM = re.compile(r"[a-z0-9_]+")  # what mkdtemp puts after the prefix
_TOKEN_BYTES = 256
logger = logging.getLogger("exportlm.stream")


def _prefix(output: Path) -> str:
    return f".{output.name}.stream-"


def _token_payload(path: Path) -> bytes:
    return f"exportlm streaming work directory {path.name}".encode()


class WorkDirectory:
    """One work directory and the open, ``flock``-ed descriptor of its lock file."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._fd: int | None = lock_fd

    def release(self) -> None:
        """Give up the lock (the directory stays, for a later run to continue)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        """Delete the directory (symbolic links inside are removed, never followed), then unlock."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()


def create(output: Path) -> WorkDirectory:
    """A fresh private work directory for ``output``, locked by this run."""
    output.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=_prefix(output), dir=output.parent))
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path / _LOCK, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, (sign(_token_payload(path)) or "").encode())
    except BaseException:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    return WorkDirectory(path, fd)


def leftovers(output: Path) -> Iterator[WorkDirectory]:
    """The dead work directories of earlier runs for ``output``, each locked while yielded
    (see the module docstring); the caller continues, removes or releases each."""
    prefix = _prefix(output)
    for entry in sorted(output.parent.glob(prefix + "*")):
        if not _RANDOM.fullmatch(entry.name[len(prefix) :]):
            continue  # another output's (``out.stream-x``), or not a mkdtemp name
        fd = _claim(entry)
        if fd is not None:
            yield WorkDirectory(entry, fd)


def _claim(entry: Path) -> int | None:
    """The locked descriptor of ``entry``'s lock when ``entry`` is ours and dead, else None."""
    try:
        info = os.lstat(entry)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        logger.info("ignoring %s: not a private directory of this user", entry)
        return None
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(entry / _LOCK, flags)
    except OSError:
        logger.info("ignoring %s: no lock file of a streaming export", entry)
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{entry / _LOCK} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: a live run holds it
        os.close(fd)
        return None
    token = os.pread(fd, _TOKEN_BYTES, 0).decode("ascii", "replace")
    if verify_signature(_token_payload(entry), token):
        return fd
    os.close(fd)
    logger.info("ignoring %s: not made by a streaming export of this user", entry)
    return None
