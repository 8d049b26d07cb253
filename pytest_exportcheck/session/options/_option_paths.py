"""Paths named by ``--export-*`` options, checked before the run starts.

A path of the wrong kind (a file where a directory is expected, a FIFO or device
where a file is read) and an unwritable report location are usage errors naming
the option, raised while the options are read. Imports only pytest (exportlm only
when there is a path to check).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import pytest

__all__ = ["check_kind", "check_report_path"]


def check_kind(path: Path | None, option: str, *, directory: bool) -> None:
    """An existing ``path`` of the wrong kind (a file for a directory, a FIFO) is a usage error.

    Only ``stat``, nothing opened (a FIFO cannot block); a missing path is left to its reader.
    exportlm is imported only when there is a path to check (a passive run imports none).
    """
    if path is None or not path.exists():
        return
    from exportlm.errors import NotRegularFileError
    from exportlm.safeio import ensure_directory, ensure_regular_file

    try:
        (ensure_directory if directory else ensure_regular_file)(path, what=option)
    except NotRegularFileError as err:
        raise pytest.UsageError(
            f"{option}: {path} is a {err.kind}; expected the path of a {err.expected}"
        ) from err


def check_report_path(path: Path) -> None:
    """Refuse an ``--export-report`` path the report could not be written to, up front.

    The report is written at the end of the run, atomically (a temporary sibling,
    then ``os.replace``; missing parent directories are created). This probes that
    now, the same way and without leaving anything behind, so an unwritable path is
    a usage error naming the path and the OS error before any export runs.
    """
    what = f"--export-report: cannot write the JSON report to {path}"
    if path.is_dir():
        raise pytest.UsageError(f"{what}: it is a directory; give the path of a .json file")
    if path.exists() and not path.is_file():
        raise pytest.UsageError(
            f"{what}: it exists and is not a regular file (a device, FIFO or socket); "
            "give the path of a .json file"
        )
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
        if existing == path.parent:
            fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=existing)
            os.close(fd)
            os.unlink(probe)
        else:  # the report creates the missing directories: can one be created here?
            shutil.rmtree(tempfile.mkdtemp(prefix=".exportcheck-report.", dir=existing))
    except OSError as err:
        reason = err.strerror or type(err).__name__
        where = f" ({err.filename})" if err.filename else ""
        raise pytest.UsageError(
            f"{what}: {reason}{where} [errno {err.errno}]; choose a writable location or fix "
            "the permissions"
        ) from err
