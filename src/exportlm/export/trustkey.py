"""This machine's per-user signing key: what lets a manifest prove "written here".

A manifest written by :func:`~exportlm.export.manifest.write_manifest` carries an
HMAC-SHA256 of its canonical JSON (file hashes included) under a secret key that
only this user on this machine can read. :func:`~exportlm.export.load_exported`
loads an artifact whose format can execute code without ``trust=True`` only when
that signature verifies: the artifact was written by an exportlm process of this
user, and no byte of it changed since.

The key is 32 random bytes in a file created on first use with mode ``0600``:

* ``$EXPORTLM_KEY_FILE`` when set (CI: point it at a per-job location);
* else ``$EXPORTLM_HOME/key`` when ``EXPORTLM_HOME`` is set;
* else ``~/.cache/exportlm/key``.

A key file that others may read or write (mode ``& 0o077``) proves nothing: it is
ignored with a warning, and signatures made with it do not verify. The same policy
holds for a key path that is not a regular file (a directory, a FIFO, a device, a
symbolic link): it is ignored with a warning, never opened for reading (a FIFO
would block) and never replaced; manifests are then written unsigned.
:func:`key_problem` says what is wrong (and what to do) without warning: the
conformance plugin asks it once per run and then signs with a temporary key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import warnings
from pathlib import Path

from exportlm.errors import NotRegularFileError
from exportlm.safeio import open_regular

__all__ = ["KEY_FILE_ENV", "HOME_ENV", "key_path", "key_problem", "sign", "verify_signature"]

KEY_FILE_ENV = "EXPORTLM_KEY_FILE"
HOME_ENV = "EXPORTLM_HOME"
_KEY_BYTES = 32


def key_path() -> Path:
    """Where this user's signing key lives (see the module docstring)."""
    explicit = os.environ.get(KEY_FILE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home).expanduser() / "key"
    return Path.home() / ".cache" / "exportlm" / "key"


_UNSIGNED = "manifests are written unsigned and loading code-executing artifacts needs trust=True"
#: What is wrong with a key, and what to do about it.
_Problem = tuple[str, str]


def _load_key(path: Path) -> tuple[bytes | None, _Problem | None]:
    """``(key, None)``, ``(None, None)`` when absent, or ``(None, (what is wrong, what to do))``."""
    try:
        handle = open_regular(path, what="exportlm signing key", nofollow=True)
    except FileNotFoundError:
        return None, None
    except NotRegularFileError as err:  # a directory, FIFO or device: never read, never replaced
        return None, (
            f"the exportlm signing key at {path} is a {err.kind}, not a regular file",
            f"Set {KEY_FILE_ENV} to the path of a private regular file (a missing one is created).",
        )
    except OSError as err:  # a parent that is a file, a symlinked key, no permission...
        what = (
            f"the exportlm signing key at {path} is a symbolic link, never followed"
            if path.is_symlink()
            else f"cannot read the exportlm signing key at {path} ({err})"
        )
        return None, (what, f"Set {KEY_FILE_ENV} to a private, readable file.")
    with handle:
        info = os.fstat(handle.fileno())
        if os.name == "posix" and (info.st_mode & 0o077 or info.st_uid != os.getuid()):
            return None, (
                f"exportlm signing key {path} is not a private file of this user (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); it proves nothing",
                "Remove it (a new one is created) or chmod 600 it.",
            )
        data = handle.read(_KEY_BYTES + 1)
    if len(data) != _KEY_BYTES:
        return None, (
            f"exportlm signing key {path} is not {_KEY_BYTES} bytes ({'empty' if not data else 'other size'})",
            "Remove it and a new one is created on the next export.",
        )
    return data, None


def _create_key(path: Path) -> tuple[bytes | None, _Problem | None]:
    """Create the key file (``0600``, exclusive); a concurrent creator's key wins."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_bytes(_KEY_BYTES)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(key)
        try:
            os.link(tmp, path)  # fails if another process created the key first
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return _load_key(path)


def _blocked(path: Path) -> bool:
    """True when a parent of ``path`` exists but is not a directory (no key can go there)."""
    return any(p.exists() and not p.is_dir() for p in path.parents)


def _usable_key(create: bool) -> tuple[bytes | None, _Problem | None]:
    """This user's key (created when missing and ``create``), or what is wrong with it."""
    path = key_path()
    key, problem = _load_key(path)
    if key is not None or problem is not None or not create:
        return key, problem
    if os.path.lexists(path) or _blocked(path):
        return None, (
            f"no exportlm signing key can be created at {path} (a parent is not a directory)",
            f"Set {KEY_FILE_ENV} to a writable location.",
        )
    try:
        return _create_key(path)
    except OSError as err:
        return None, (
            f"cannot create the exportlm signing key at {path} ({err})",
            f"Set {KEY_FILE_ENV} to a writable location.",
        )


def _key(create: bool) -> bytes | None:
    key, problem = _usable_key(create)
    if problem is not None:
        what, todo = problem
        warnings.warn(f"{what}; it is ignored, so {_UNSIGNED}. {todo}", UserWarning, stacklevel=3)
    return key


def key_problem() -> str | None:
    """What makes this user's signing key unusable, with what to do; ``None`` when it is usable.

    Creates the key when it is missing (as the first :func:`sign` would); warns
    nothing. The conformance plugin asks this once per run and reports the answer
    once, instead of failing every code-executing target's load.
    """
    problem = _usable_key(create=True)[1]
    return None if problem is None else f"{problem[0]}. {problem[1]}"


def sign(payload: bytes) -> str | None:
    """HMAC-SHA256 of ``payload`` (hex) under this user's key, creating the key if needed.

    ``None`` when no usable key can be had (warned).
    """
    key = _key(create=True)
    if key is None:
        return None
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def verify_signature(payload: bytes, signature: str | None) -> bool:
    """True when ``signature`` is this user's HMAC of ``payload``; never creates a key."""
    if not signature:
        return False
    key = _key(create=False)
    if key is None:
        return False
    expected = hmac.new(key, payload, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, signature)
