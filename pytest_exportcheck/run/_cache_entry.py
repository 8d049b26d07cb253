"""One entry of the artifact cache on disk: written signed, read only after it verifies.

The cache is data, not code. A cached ``.pt2`` or TorchScript file runs code when
it is loaded, and the cache directory may come from elsewhere (a restored CI
cache), so an entry is used only when all of this holds:

* ``meta.json`` is a regular file holding this cache format, signed with this
  user's HMAC key (:mod:`exportlm.export.trustkey`): the entry was written on
  this machine and nobody changed its metadata since;
* the cache key inside the signed ``meta.json`` is the key it is read under: an
  entry moved, copied or exchanged under another key (whose artifacts all carry the
  same file name) is another export's, not this one;
* its ``artifact`` path is relative, without ``..``, and stays inside ``out/``;
* ``out/`` holds regular files and directories only (no symbolic link, device or
  FIFO), exactly the files ``meta.json`` lists, each with its listed size and
  sha256;
* where the artifact has an exportlm manifest, the artifact verifies against it
  (:func:`exportlm.export.manifest.verify_artifact`), and for a target whose
  format executes code when loaded, the manifest is this machine's own.

Anything else raises :class:`UnsoundEntryError`: the caller evicts the entry and
rebuilds it with a warning, never loads it and never reports it as the target's
failure.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from exportlm.errors import UnsafeLockFileError
from exportlm.export.manifest import file_sha256
from exportlm.safeio import open_lock_file

__all__ = ["META", "UnsoundEntryError", "evict", "read_entry", "sweep_dead_writers", "write_meta"]

META = "meta.json"

logger = logging.getLogger(__name__)


class UnsoundEntryError(Exception):
    """A cache entry exists but cannot be used; the message says why."""


def _canonical(meta: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in meta.items() if k != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _walk(out: Path) -> Iterator[Path]:
    """Every file under ``out`` (relative); raises on a link or a special file."""
    for directory, dirs, files in os.walk(out, followlinks=False):
        for name in [*dirs, *files]:
            path = Path(directory) / name
            relative = path.relative_to(out).as_posix()
            if path.is_symlink():
                raise UnsoundEntryError(f"out/{relative} is a symbolic link")
            if name in files:
                if not path.is_file():
                    raise UnsoundEntryError(f"out/{relative} is not a regular file")
                yield path


def write_meta(
    staging: Path, artifact: Path, fields: Mapping[str, Any], cache_format: int, *, key: str
) -> None:
    """Write the signed ``meta.json`` of the entry for ``key`` staged in ``staging``."""
    from exportlm.export import trustkey

    out = staging / "out"
    meta: dict[str, Any] = {
        **fields,
        "key": key,
        "format": cache_format,
        "artifact": artifact.relative_to(out).as_posix(),
        "files": {
            p.relative_to(out).as_posix(): {"sha256": file_sha256(p), "size": p.stat().st_size}
            for p in sorted(_walk(out))
        },
    }
    signature = trustkey.sign(_canonical(meta))
    if signature is not None:
        meta["hmac"] = signature
    (staging / META).write_text(json.dumps(meta, indent=1, sort_keys=True))


def read_entry(entry: Path, cache_format: int, *, executes_code: bool, key: str) -> Path | None:
    """The artifact of the published entry ``entry`` for ``key``; ``None`` when there is none.

    Raises:
        UnsoundEntryError: the entry exists but fails a check of the module docstring.
    """
    if not os.path.lexists(entry):
        return None
    if entry.is_symlink() or not entry.is_dir():
        raise UnsoundEntryError("the entry is not a plain directory")
    meta = _read_meta(entry / META, cache_format)
    if meta.get("key") != key:
        raise UnsoundEntryError(
            f"its signed {META} was written for another cache key ({meta.get('key')!r}, "
            f"expected {key!r}): the entry was moved or exchanged with another"
        )
    out = entry / "out"
    artifact = out / _confined(meta.get("artifact"))
    if out.is_symlink() or not out.is_dir():
        raise UnsoundEntryError("out/ is missing or not a plain directory")
    _check_files(out, meta.get("files"))
    if not os.path.lexists(artifact) or not artifact.resolve().is_relative_to(out.resolve()):
        raise UnsoundEntryError(f"its artifact out/{meta['artifact']} is missing")
    _check_manifest(artifact, executes_code)
    return artifact


def _read_meta(path: Path, cache_format: int) -> dict[str, Any]:
    from exportlm.export import trustkey

    if path.is_symlink() or not path.is_file():
        raise UnsoundEntryError(f"{META} is missing or not a regular file")
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:
        raise UnsoundEntryError(f"{META} is unreadable or truncated ({err})") from err
    if not isinstance(meta, dict) or meta.get("format") != cache_format:
        raise UnsoundEntryError(f"{META} is not of cache format {cache_format}")
    if not trustkey.verify_signature(_canonical(meta), meta.get("hmac")):
        raise UnsoundEntryError(
            f"{META} is not signed with this user's exportlm key: the entry was not written "
            "here, or was changed after it was"
        )
    return meta


def _confined(name: Any) -> str:
    """``name`` if it is a relative path that stays below ``out/``; raises otherwise."""
    if not isinstance(name, str) or not name:
        raise UnsoundEntryError(f"{META} names no artifact")
    for pure in (PurePosixPath(name), PureWindowsPath(name)):
        if pure.is_absolute() or pure.anchor or ".." in pure.parts:
            raise UnsoundEntryError(
                f"{META} names the artifact {name!r}, a path that leaves the entry"
            )
    return name


def _check_files(out: Path, listed: Any) -> None:
    if not isinstance(listed, dict) or not listed:
        raise UnsoundEntryError(f"{META} lists no files")
    present = {p.relative_to(out).as_posix(): p for p in _walk(out)}
    if set(present) != set(listed):
        missing = sorted(set(listed) - set(present))
        extra = sorted(set(present) - set(listed))
        raise UnsoundEntryError(f"its files differ from {META} (missing {missing}, extra {extra})")
    for name, path in sorted(present.items()):
        entry = listed[name]
        if not isinstance(entry, dict):
            raise UnsoundEntryError(f"{META} has no hash for out/{name}")
        if path.stat().st_size != entry.get("size") or file_sha256(path) != entry.get("sha256"):
            raise UnsoundEntryError(f"out/{name} does not match its sha256 (truncated or changed)")


def _check_manifest(artifact: Path, executes_code: bool) -> None:
    """Verify the artifact against its exportlm manifest, where it has one."""
    try:
        from exportlm.export.manifest import read_manifest, verify_artifact
    except ImportError:  # pragma: no cover - an exportlm without manifests
        return
    from exportlm.errors import ArtifactIntegrityError

    try:
        manifest = read_manifest(artifact)
        if manifest is None:
            return
        verify_artifact(artifact, manifest=manifest)  # the manifest read once is the one checked
    except ArtifactIntegrityError as err:
        raise UnsoundEntryError(
            f"the artifact does not verify against its manifest: {err}"
        ) from err
    if executes_code and not manifest.is_own():
        raise UnsoundEntryError(
            "the artifact's format executes code when loaded and its manifest is not signed "
            "by this machine"
        )


def evict(entry: Path) -> None:
    """Move ``entry`` out of the way (one rename), then remove it."""
    if not os.path.lexists(entry):
        return
    graveyard = Path(tempfile.mkdtemp(prefix=f".{entry.name}.evicted-", dir=entry.parent))
    os.replace(entry, graveyard / "entry")
    shutil.rmtree(graveyard, ignore_errors=True)


def sweep_dead_writers(root: Path, key_length: int) -> list[Path]:
    """Remove the staging and evicted directories that dead writers left in ``root``.

    A writer stages ``.<key>.*`` only while it holds ``<key>.lock`` (an ``fcntl``
    lock, released by the kernel when its process dies), so a staging directory
    whose lock can be taken without waiting has no live writer. A lock path that is
    not a private regular file (a planted link) is never opened: that directory stays. Returns what was
    removed. Where ``fcntl`` is missing (Windows) nothing is removed.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return []
    removed: list[Path] = []
    for path in sorted(root.glob(".*.*")):
        key = path.name[1:].split(".", 1)[0]
        if len(key) != key_length or not path.is_dir() or path.is_symlink():
            continue
        try:
            fd = open_lock_file(root / f"{key}.lock")
        except UnsafeLockFileError as err:  # planted: never followed; the directory stays
            logger.warning("not sweeping %s: %s", path, err)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
