"""All-or-nothing writes: the one home of every atomic file and directory write in the project.

Every writer here stages its output in a temporary sibling of the destination
(same directory, so the same filesystem) and publishes it with ``os.replace``,
which POSIX and Windows make atomic for a single name. A reader therefore sees
the old content or the new one, never a part; a writer that fails (an
exception, or a crash of the process) leaves the destination as it was and
removes what it staged, where it still runs to do so.

* :func:`atomic_output`: a context manager yielding the staged path of a file
  or directory artifact that an exporter writes in several steps.
* :func:`replace_directory`: swap a finished directory into place, also over
  an existing one.
* :func:`write_text_atomic` / :func:`write_bytes_atomic`: one small file in one
  call (goldens, caches, reports).

What is published gets the modes a plain ``mkdir`` / ``open`` would give it under
the process umask (``0755`` directories, ``0644`` files under umask ``022``, as
``save_pretrained`` writes them), not the private ``0700`` / ``0600`` of the
temporaries it was staged in.

The files are not ``fsync``\\ ed: the guarantee covers concurrent readers and
failing writers, not the loss of the page cache in a power cut.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from exportlm.errors import OutputExistsError

__all__ = ["atomic_output", "replace_directory", "write_bytes_atomic", "write_text_atomic"]


@contextlib.contextmanager
def atomic_output(
    path: str | os.PathLike[str], *, directory: bool = False, overwrite: bool = True
) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; move it into place only on success.

    On any exception the temporary is removed and an existing ``path`` is left
    untouched. For ``directory=True`` the yielded path is an empty directory and
    an existing non-empty directory is replaced only when ``overwrite`` is true
    (otherwise :class:`~exportlm.errors.OutputExistsError`).

    For a file, whatever else the exporter writes beside the yielded path (e.g.
    ONNX external data) is moved next to ``path`` first and ``path`` itself
    last, so a reader never sees the artifact without its data.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not overwrite and target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise OutputExistsError(
            f"{target} exists and is not empty; pass overwrite=True to replace it atomically"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    staged = tmp if directory else tmp / target.name
    try:
        yield staged
        if directory:
            replace_directory(tmp, target)
        else:
            if not staged.exists():
                raise FileNotFoundError(f"exporter wrote nothing at {staged}")
            _apply_umask_modes(tmp)
            for extra in sorted(tmp.iterdir()):
                if extra != staged:
                    os.replace(extra, target.parent / extra.name)
            os.replace(staged, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_directory(new: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Move the finished directory ``new`` to ``target``, replacing what is there.

    An existing directory at ``target`` is first renamed to a hidden sibling, then
    ``new`` takes its name and the old one is deleted; if the second rename fails
    the old directory is put back. A file or symbolic link at ``target`` is
    unlinked first. ``new`` must be on the same filesystem as ``target`` (a
    sibling, as :func:`atomic_output` stages it). Before the swap, ``new`` and
    everything in it get the umask's modes (see the module docstring): a
    ``tempfile.mkdtemp`` staging directory is private (``0700``), the published
    directory is not.
    """
    new_path, target_path = Path(new), Path(target)
    _apply_umask_modes(new_path)
    if target_path.is_dir() and not target_path.is_symlink():
        old = target_path.with_name(
            f".{target_path.name}.old-{os.getpid()}-{threading.get_ident()}"
        )
        os.replace(target_path, old)
        try:
            os.replace(new_path, target_path)
        except BaseException:
            os.replace(old, target_path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        if target_path.exists() or target_path.is_symlink():
            target_path.unlink()
        os.replace(new_path, target_path)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and ``os.replace``.

    Parent directories are created. Safe under concurrent writers (pytest-xdist
    workers): the last complete write wins and a reader never sees a part. The
    file gets the mode a plain ``open`` would give it under the process umask.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
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
