"""Opening files whose paths come from users, without blocking and without surprises.

Every path that a user, an environment variable or a file we did not write hands
to exportlm (a key file, calibration data, an xfails file, a checkpoint's
``config.json`` and shards, an ONNX file) is opened here. A FIFO, a device, a
socket or a directory where a regular file is expected raises
:class:`~exportlm.errors.NotRegularFileError` *before* anything is read: the file
is opened with ``O_NONBLOCK`` (so a FIFO with no writer does not block the
``open``), checked with ``fstat`` on that descriptor (so the check and the read
see the same file), and only then read, in blocking mode.

Lock files live in directories others may write too (a restored CI cache, a shared
checkout): :func:`open_lock_file` never follows a link planted at a lock path and never
creates or truncates anything but a new private file (:func:`exclusive_lock` holds one).

Torch-free and dependency-free, so the plugin and the CLI use it too.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from exportlm.errors import InputTooLargeError, NotRegularFileError, UnsafeLockFileError

__all__ = [
    "ensure_directory",
    "ensure_no_special_files",
    "ensure_regular_file",
    "exclusive_lock",
    "file_kind",
    "open_lock_file",
    "open_regular",
    "read_regular_bytes",
    "read_regular_text",
]

_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def file_kind(mode: int) -> str:
    """A readable name for the file type in ``mode`` (``"regular file"``, ``"FIFO"``, ...)."""
    if stat.S_ISREG(mode):
        return "regular file"
    for test, name in _KINDS:
        if test(mode):
            return name
    return "special file"


def ensure_regular_file(path: str | os.PathLike[str], *, what: str) -> Path:
    """``path`` as a :class:`Path` if it is a regular file (links followed).

    Raises :class:`NotRegularFileError` for anything else that exists; a missing
    path raises :class:`FileNotFoundError` as ``os.stat`` does. Never opens the file.
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(path, what, file_kind(mode))
    return Path(path)


def ensure_directory(path: str | os.PathLike[str], *, what: str) -> Path:
    """``path`` as a :class:`Path` if it is a directory (links followed).

    Anything else that exists raises :class:`NotRegularFileError` with
    ``expected="directory"``; a missing path raises :class:`FileNotFoundError`.
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise NotRegularFileError(path, what, file_kind(mode), expected="directory")
    return Path(path)


def ensure_no_special_files(
    directory: str | os.PathLike[str], *, what: str, max_depth: int = 1
) -> Path:
    """``directory`` as a :class:`Path` once nothing in it is a FIFO, device or socket.

    For a directory handed whole to a library that opens its files itself
    (transformers, safetensors, datasets), where no :func:`open_regular` can come
    between. Entries are checked with links followed, ``max_depth`` levels deep
    (1: the directory's own entries); a dangling link is left to the library.
    Raises :class:`NotRegularFileError` naming the first special file (as a
    "``what`` file"), or ``directory`` itself when it is not a directory.
    """
    root = ensure_directory(directory, what=what)
    pending = [(root, 1)]
    while pending:
        folder, depth = pending.pop()
        for entry in sorted(folder.iterdir()):
            try:
                mode = os.stat(entry).st_mode
            except FileNotFoundError:  # a dangling link: nothing there to block on
                continue
            if stat.S_ISDIR(mode):
                if depth < max_depth:
                    pending.append((entry, depth + 1))
            elif not stat.S_ISREG(mode):
                raise NotRegularFileError(entry, f"{what} file", file_kind(mode))
    return root


def open_regular(path: str | os.PathLike[str], *, what: str, nofollow: bool = False) -> BinaryIO:
    """Open ``path`` for binary reading, refusing anything but a regular file before reading.

    The returned handle is positioned at 0 and blocking. ``nofollow`` refuses a
    symbolic link as the last component (``O_NOFOLLOW``; raises ``OSError``).
    Missing files raise :class:`FileNotFoundError`; other ``OSError`` propagate.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if nofollow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(path, what, file_kind(mode))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return io.open(fd, "rb", closefd=True)  # noqa: UP020 - a descriptor, not a path
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(
    path: str | os.PathLike[str], *, what: str, max_bytes: int | None = None
) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`).

    With ``max_bytes``, a larger file raises :class:`~exportlm.errors.InputTooLargeError`
    (a :class:`ValueError`) naming the limit: judged by the size ``fstat`` reports
    before a byte is read (a sparse file of terabytes costs nothing), and by what
    the read returns (a file that grows meanwhile), so at most ``max_bytes + 1``
    bytes are ever held.
    """
    with open_regular(path, what=what) as handle:
        if max_bytes is None:
            return handle.read()
        size = os.fstat(handle.fileno()).st_size
        data = b"" if size > max_bytes else handle.read(max_bytes + 1)
    if size > max_bytes or len(data) > max_bytes:
        raise InputTooLargeError(
            f"{what} {path} is larger than {max_bytes} bytes ({max(size, len(data))} bytes); "
            "pass a smaller file.",
            what=what,
            size=max(size, len(data)),
            limit=max_bytes,
        )
    return data


def read_regular_text(
    path: str | os.PathLike[str],
    *,
    what: str,
    max_bytes: int | None = None,
    encoding: str = "utf-8",
) -> str:
    """The text of the regular file ``path``; undecodable bytes raise :class:`UnicodeDecodeError`."""
    return read_regular_bytes(path, what=what, max_bytes=max_bytes).decode(encoding)


def open_lock_file(path: str | os.PathLike[str]) -> int:
    """A descriptor of the lock file ``path``, created ``0600`` if missing; never through a link.

    A missing file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``, so a symbolic
    link planted at ``path`` (even a dangling one, pointing at ``.git/index.lock`` or
    at the signing key) is never followed and nothing is created or truncated at its
    target. An existing file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and kept only
    when ``fstat`` shows a regular file of this user with a single link. Anything else
    raises :class:`~exportlm.errors.UnsafeLockFileError`. The caller ``flock``\\ s the
    descriptor and closes it.
    """
    common = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | common, 0o600)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | common)
    except FileNotFoundError:  # removed since: one more exclusive try
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | common, 0o600)
    except OSError as err:  # ELOOP: a symbolic link
        if os.path.islink(path):
            raise UnsafeLockFileError(path, "a symbolic link") from err
        raise
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = f"a {file_kind(info.st_mode)}"
    elif hasattr(os, "getuid") and info.st_uid != os.getuid():
        problem = f"a file of another user (uid {info.st_uid})"
    elif info.st_nlink != 1:
        problem = f"a file with {info.st_nlink} hard links"
    if problem is not None:
        os.close(fd)
        raise UnsafeLockFileError(path, problem)
    return fd


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the lock file ``path`` (:func:`open_lock_file`).

    Raises :class:`~exportlm.errors.UnsafeLockFileError` before locking anything when
    the path is unsafe. Where ``fcntl`` is missing (Windows) nothing is opened.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: callers resolve races otherwise
        yield
        return
    fd = open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
