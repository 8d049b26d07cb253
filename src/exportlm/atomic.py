"""All-or-nothing writes: the one home of every atomic file and directory write in the project.

Every writer stages its output in a private temporary sibling of the destination
(``.NAME.XXXXXXXX.tmp/``, same directory, so the same filesystem) and publishes it
with renames. The guarantees, and their limits:

* **File artifacts** (:func:`atomic_output`): companion files the exporter wrote
  beside the artifact (ONNX external data) must carry names unique to their content
  or writer; they are published first, the artifact file last, each by ``os.replace``.
  A reader sees the old artifact or the new one, never the new graph on old data or
  the old graph on new data. Files written by the ``before_publish`` hook (the
  manifest) are published after the artifact. Companions of earlier exports that the
  new artifact no longer uses are removed afterwards (``companions`` patterns).
* **Directory artifacts**: the staged directory is exchanged with the existing one by
  ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+, on ext4, xfs, btrfs, tmpfs and most
  local filesystems): the path names the old tree or the new one at every instant,
  never nothing. Where the exchange is unavailable (other systems, some network
  filesystems) the fallback renames the old tree aside and the new one in: a window
  of two renames in which the path does not exist; a crash inside it leaves the old
  tree in a ``.NAME.*.tmp`` sibling, which the next export removes.
* **Concurrent writers** to one path: publishing takes an exclusive ``flock`` on the
  parent directory (POSIX), so the last writer to publish wins whole and every writer
  returns normally or raises.
* **Crashes** (including SIGKILL): the staging directory of a dead writer is removed
  by the next :func:`atomic_output` to the same path; a writer holds an ``flock`` on
  ``.writer.lock`` inside its staging directory, so a live writer is never disturbed.
* **Special files** (``/dev/null``, FIFOs, sockets) are refused, never replaced.

Published modes follow the umask (``0755`` / ``0644`` under ``022``, as ``save_pretrained``),
not the private ones of the staging area. Nothing is ``fsync``\\ ed: the guarantee covers
readers, failing and killed writers, not a power cut.

:func:`publish_steps` lets a fault-injection test observe (and fail, or kill the
process at) every publishing step; the conformance suite uses it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from exportlm.errors import OutputExistsError, UnsupportedOutputPathError

__all__ = [
    "PublishHook",
    "atomic_output",
    "check_output_path",
    "publish_steps",
    "remove_stale_staging",
    "replace_directory",
    "write_bytes_atomic",
    "write_text_atomic",
]

_LOCK_NAME, _PAYLOAD = ".writer.lock", "payload"
_STALE_GRACE_S = 60.0  # a staging entry without a writer lock may be being created

#: ``(staged artifact, destination) -> files written for publishing after the artifact``.
PublishHook = Callable[[Path, Path], Sequence[Path]]
_STEP_OBSERVERS: list[Callable[[str, Path], None]] = []


@contextlib.contextmanager
def publish_steps(observer: Callable[[str, Path], None]) -> Iterator[None]:
    """Call ``observer(step, path)`` before every publishing step of this process (testing aid).

    Steps: ``"staged"``, ``"hook"``, ``"replace"`` (per file), ``"exchange"`` / ``"rename"``
    (a directory), ``"prune"``. An observer that raises fails that step; one that kills
    the process simulates a crash there.
    """
    _STEP_OBSERVERS.append(observer)
    try:
        yield
    finally:
        _STEP_OBSERVERS.remove(observer)


def _step(name: str, path: Path) -> None:
    for observer in list(_STEP_OBSERVERS):
        observer(name, path)


def check_output_path(path: str | os.PathLike[str]) -> None:
    """Raise :class:`UnsupportedOutputPathError` if ``path`` is a device, FIFO or socket (links followed)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise UnsupportedOutputPathError(
            f"{path} exists and is not a regular file or directory (a device, FIFO or "
            "socket); exportlm never replaces one. Choose a file or directory path."
        )


@contextlib.contextmanager
def atomic_output(
    path: str | os.PathLike[str],
    *,
    directory: bool = False,
    overwrite: bool = True,
    companions: Sequence[str] = (),
    before_publish: PublishHook | None = None,
) -> Iterator[Path]:
    """Yield a staged path for ``path``; publish it all at once only on success.

    On any exception the staging area is removed and an existing ``path`` is left
    untouched. For ``directory=True`` the yielded path is an empty directory and an
    existing non-empty directory is replaced only when ``overwrite`` is true
    (otherwise :class:`~exportlm.errors.OutputExistsError`).

    For a file, whatever else the exporter writes beside the yielded path is a
    companion, published before ``path`` (give it a content- or writer-unique name).
    ``companions`` are glob patterns (e.g. ``"model.onnx.*.data"``) of sibling names
    that belong to the artifact: after publishing, those the new artifact did not
    write are removed. Leftovers of dead writers to ``path`` are removed first.

    ``before_publish(staged, path)`` runs once the body is done and before anything is
    published; the files it returns (the manifest) are published after the artifact,
    and if it raises, nothing is.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    check_output_path(target)
    _refuse_non_empty(target, directory, overwrite)
    remove_stale_staging(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        with _writer_lock(tmp):
            payload = tmp / _PAYLOAD
            payload.mkdir(mode=0o700)
            staged = payload if directory else payload / target.name
            yield staged
            _step("staged", staged)
            if not directory and not staged.exists():
                raise FileNotFoundError(f"exporter wrote nothing at {staged}")
            last: list[Path] = []
            if before_publish is not None:
                _step("hook", staged)
                last.extend(Path(p) for p in before_publish(staged, target))
            _apply_umask_modes(payload)
            with _publish_lock(target.parent):
                check_output_path(target)
                if directory:
                    _refuse_non_empty(target, directory, overwrite)
                    _swap_directory(payload, target)
                else:
                    _publish_files(payload, staged, target, last, companions)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _refuse_non_empty(target: Path, directory: bool, overwrite: bool) -> None:
    if overwrite or not target.exists():
        return
    if not target.is_dir() or any(target.iterdir()):
        raise OutputExistsError(
            f"{target} exists and is not empty; pass overwrite=True to replace it atomically"
        )


def _publish_files(
    payload: Path, staged: Path, target: Path, last: list[Path], companions: Sequence[str]
) -> None:
    """Companions first, the artifact, then the hook's files; then prune unused companions."""
    late = {p.name for p in last}
    extras = sorted(p for p in payload.iterdir() if p != staged and p.name not in late)
    for extra in extras:
        _step("replace", target.parent / extra.name)
        os.replace(extra, target.parent / extra.name)
    for late_name in sorted(late):  # the previous manifest must not describe the new artifact
        (target.parent / late_name).unlink(missing_ok=True)
    _step("replace", target)
    os.replace(staged, target)
    for late_name in sorted(late):
        _step("replace", target.parent / late_name)
        os.replace(payload / late_name, target.parent / late_name)
    keep = {p.name for p in extras}
    for pattern in companions:
        for old in sorted(target.parent.glob(pattern)):
            if old.name not in keep and old.name != target.name and old.is_file():
                _step("prune", old)
                old.unlink(missing_ok=True)


def replace_directory(new: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Move the finished directory ``new`` to ``target``, replacing what is there.

    An existing directory is exchanged atomically where the system can (see the module
    docstring) and then deleted; a file or symbolic link at ``target`` is replaced.
    ``new`` must be on the same filesystem as ``target`` (a sibling). Before the swap
    ``new`` and everything in it get the umask's modes (a ``mkdtemp`` directory is
    private, the published one is not).
    """
    new_path, target_path = Path(new), Path(target)
    check_output_path(target_path)
    _apply_umask_modes(new_path)
    with _publish_lock(target_path.parent):
        _swap_directory(new_path, target_path)
    shutil.rmtree(new_path, ignore_errors=True)


def _swap_directory(new: Path, target: Path) -> None:
    """Put ``new`` at ``target``; what was there ends up at ``new`` (the caller removes it)."""
    if target.is_dir() and not target.is_symlink():
        _step("exchange", target)
        if _rename_exchange(new, target):
            return
        # Fallback: a two-rename window in which ``target`` does not exist.
        aside = new.with_name(new.name + ".old")
        os.replace(target, aside)
        try:
            os.replace(new, target)
        except BaseException:
            os.replace(aside, target)
            raise
        os.replace(aside, new)
        return
    _step("rename", target)
    if target.is_symlink() or target.is_file():
        target.unlink()  # a directory cannot replace a file or link by rename(2)
    os.replace(new, target)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths with Linux ``renameat2``; False where unsupported."""
    if not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


@contextlib.contextmanager
def _writer_lock(tmp: Path) -> Iterator[None]:
    """Hold an ``flock`` on ``tmp/.writer.lock`` while this writer lives (POSIX)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: stale staging is aged out instead
        yield
        return
    fd = os.open(tmp / _LOCK_NAME, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _publish_lock(parent: Path) -> Iterator[None]:
    """Serialize publishing in ``parent`` among processes (``flock`` on the directory, POSIX)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _writer_alive(entry: Path) -> bool:
    """Whether the writer that owns the staging entry may still be running."""
    lock = entry / _LOCK_NAME
    if entry.is_dir() and lock.is_file():
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return time.time() - entry.stat().st_mtime < _STALE_GRACE_S
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)  # a FIFO never blocks
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False
    # No lock (being created, or left by an older exportlm or a write_bytes_atomic): age it out.
    return time.time() - entry.lstat().st_mtime < _STALE_GRACE_S


def _owned(entry: Path) -> bool:
    """Whether this user owns ``entry`` itself (a link is not followed)."""
    return not hasattr(os, "getuid") or os.lstat(entry).st_uid == os.getuid()


def remove_stale_staging(path: str | os.PathLike[str]) -> list[Path]:
    """Remove ``.NAME.*.tmp`` / ``.NAME.old-*`` siblings of ``path`` left by dead writers.

    A writer is dead when nothing holds its staging lock (the kernel releases an ``flock``
    when a process dies, even by SIGKILL); a lockless entry is removed after a minute.
    Entries another user owns, and any this user cannot remove, are left alone.
    """
    target = Path(path)
    removed: list[Path] = []
    patterns = (f".{target.name}.*.tmp", f".{target.name}.old-*")
    for pattern in patterns:
        for entry in sorted(target.parent.glob(pattern)):
            try:
                if not _owned(entry) or _writer_alive(entry):
                    continue  # another user's (planted in a shared directory?): never touched
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            except FileNotFoundError:
                continue  # another writer removed it first
            except OSError:
                continue  # not ours to remove after all (permissions): left alone, never raised
            removed.append(entry)
    return removed


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and ``os.replace``.

    Parent directories are created. Safe under concurrent writers (pytest-xdist
    workers): the last complete write wins and a reader never sees a part. The
    file gets the mode a plain ``open`` would give it under the process umask.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    check_output_path(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically (see :func:`write_bytes_atomic`).

    Newlines are written as given (no platform translation), so the bytes on disk
    are the same everywhere.
    """
    write_bytes_atomic(path, text.encode(encoding))


def _apply_umask_modes(root: Path) -> None:
    """Give ``root`` and what is under it the modes ``mkdir`` / ``open`` give under the umask.

    Directories ``0o777 & ~umask``, files ``0o666 & ~umask`` (``0o777 & ~umask`` when
    the owner may execute them); symbolic links are left alone.
    """
    mask = _umask()
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    for path in paths:
        if path.is_symlink():
            continue
        if path.is_dir():
            path.chmod(0o777 & ~mask)
        else:
            executable = path.stat().st_mode & stat.S_IXUSR
            path.chmod((0o777 if executable else 0o666) & ~mask)


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process umask; reading it means setting it, so threads take turns."""
    with _UMASK_LOCK:
        mask = os.umask(0)
        os.umask(mask)
    return mask
