"""The manifest beside every artifact: what it is, what made it, and the digest of every file.

Where it lives (:func:`manifest_path`):

* a file artifact ``out/model.onnx`` -> ``out/model.onnx.manifest.json`` (a sibling);
* a directory artifact ``out/ckpt/`` -> ``out/ckpt/exportlm-manifest.json`` (inside, so it
  is swapped in together with the directory).

What it holds (schema :data:`MANIFEST_SCHEMA`): the one artifact it was written for
(its published name and kind), the target and variant, the options
(JSON-safe), versions of exportlm / torch / transformers / the target's runtime library,
the input names with their dims (names for dynamic ones), the declared tolerance, a
BLAKE3 digest of the model's structure and weights (:func:`model_hash`: the exact bytes,
no float comparison; only with ``EXPORTLM_MODEL_HASH=1`` since issue 44, else null), the BLAKE3 digest (:func:`file_digest`) and size of every file of
the artifact, the vocabulary size where known, and an HMAC-SHA256 under this user's key
(:mod:`~exportlm.export.trustkey`).

What it proves: with :func:`verify_artifact` passing, the artifact is the one the manifest
was written for (its file name, or the directory holding it) and its files are byte for
byte the ones listed; with :meth:`Manifest.is_own` too, exportlm wrote them under this
user's key on this machine. It does not
prove the model is benign, nor anything about an artifact whose manifest is unsigned
or signed elsewhere: anyone can write a manifest with matching hashes.

The manifest is written last: a complete manifest means a complete artifact.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exportlm.atomic import write_bytes_atomic
from exportlm.errors import ArtifactIntegrityError, ManifestSchemaError
from exportlm.export import trustkey
from exportlm.export._digest import DIGEST, LEGACY_DIGEST, file_digest
from exportlm.export._manifest_data import json_safe, model_hash, versions
from exportlm.export._verified import VerifiedFile, check_entry, file_sha256, verify_listed
from exportlm.safeio import read_regular_bytes

__all__ = [
    "DIRECTORY_MANIFEST_NAME",
    "MANIFEST_SCHEMA",
    "MANIFEST_SUFFIX",
    "Manifest",
    "NewerManifestWarning",
    "file_digest",
    "file_sha256",
    "json_safe",
    "manifest_path",
    "model_hash",
    "read_manifest",
    "verify_artifact",
    "write_manifest",
]

#: Schema version written by this exportlm. A reader warns on a newer one, refuses an unknown one.
#: 2: ``artifact`` (the published name and the kind) is required, and the loader holds the
#: manifest to it; schema 1 recorded the staging name of a directory (``payload``).
#: 3: BLAKE3 digests (``{"blake3", "size"}`` per file, ``model_blake3``); 1-2 list sha256.
MANIFEST_SCHEMA = 3
MANIFEST_SUFFIX = ".manifest.json"
DIRECTORY_MANIFEST_NAME = "exportlm-manifest.json"
_MAX_MANIFEST_BYTES = 64 << 20


class NewerManifestWarning(UserWarning):
    """The manifest's schema is newer than this exportlm's: fields it adds are not checked."""


def manifest_path(artifact: str | os.PathLike[str]) -> Path:
    """``<artifact>.manifest.json`` for a file, ``<dir>/exportlm-manifest.json`` for a directory."""
    path = Path(artifact)
    if path.is_dir():
        return path / DIRECTORY_MANIFEST_NAME
    return path.with_name(path.name + MANIFEST_SUFFIX)


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest (see the module docstring).

    Attributes:
        path: where it was read from.
        schema: its schema version.
        target, variant, options, versions, inputs, tolerance, model_hash, vocab_size:
            as written.
        files: ``{relative path: {"blake3": hex, "size": bytes}}`` (``"sha256"`` before
            schema 3); relative to the artifact's directory (a directory artifact) or its
            parent (a file artifact).
        artifact_name, artifact_kind: the artifact it was written for (its published
            name, ``"file"`` or ``"directory"``); ``None`` in a schema-1 manifest that
            lacks them, which then vouches for nothing.
        data: the whole JSON object, including fields a newer schema adds.
    """

    path: Path
    schema: int
    target: str
    variant: str | None
    options: Mapping[str, Any]
    versions: Mapping[str, str | None]
    inputs: Sequence[Mapping[str, Any]]
    tolerance: Mapping[str, float]
    model_hash: str | None
    vocab_size: int | None
    files: Mapping[str, Mapping[str, Any]]
    artifact_name: str | None
    artifact_kind: str | None
    data: Mapping[str, Any] = field(repr=False)

    @property
    def digest(self) -> str:
        """The digest its file entries list: ``"blake3"`` from schema 3, ``"sha256"`` before."""
        return DIGEST if self.schema >= 3 else LEGACY_DIGEST

    def is_own(self) -> bool:
        """True when its HMAC verifies under this user's key: written by exportlm on this machine.

        Only the manifest's own bytes are checked here; :func:`verify_artifact` checks
        the files against it.
        """
        return trustkey.verify_signature(_canonical(self.data), self.data.get("hmac"))


def _canonical(data: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in data.items() if k != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _file_entries(root: Path, files: Iterable[Path]) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    for path in sorted(set(files)):
        entries[path.relative_to(root).as_posix()] = {
            DIGEST: file_digest(path),
            "size": path.stat().st_size,
        }
    return entries


def _artifact_files(artifact: Path, companions: Sequence[Path]) -> tuple[Path, list[Path]]:
    """(root the manifest's names are relative to, the artifact's files)."""
    if artifact.is_dir():
        inside = [
            p for p in artifact.rglob("*") if p.is_file() and p.name != DIRECTORY_MANIFEST_NAME
        ]
        return artifact, inside
    return artifact.parent, [artifact, *companions]


def write_manifest(
    artifact: str | os.PathLike[str],
    *,
    target: str,
    variant: str | None,
    options: Mapping[str, Any],
    tolerance: Mapping[str, float],
    model_hash: str | None,
    inputs: Sequence[Mapping[str, Any]],
    runtime_library: str = "",
    vocab_size: int | None = None,
    companions: Sequence[Path] = (),
    name: str | None = None,
    files: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Hash the artifact's files and write its signed manifest atomically; returns the manifest path.

    Args:
        artifact: the artifact file or directory, complete (its files are hashed now).
        target, variant: the export target's name and the variant exported (or ``None``).
        options: the target options (made JSON-safe with :func:`json_safe`).
        tolerance: ``{"atol": ..., "rtol": ...}`` the target declares.
        model_hash: :func:`model_hash` of the exported model (``None`` if unknown or not
            asked for: ``EXPORTLM_MODEL_HASH``).
        inputs: ``[{"name", "dtype", "shape"}]``; a dynamic dim is a name (``"batch"``).
        runtime_library: the distribution the target's runtime loads with
            (``TargetInfo.runtime_library``), recorded with its version.
        vocab_size: the vocabulary, when known: runtimes refuse ids outside it.
        companions: further files of a file artifact (e.g. ONNX external data).
        name: the name the artifact is published under (default: its own), recorded
            and signed as the one artifact this manifest vouches for.
        files: the file entries (``{relative path: {"blake3", "size"}}``) as hashed
            earlier, when the files were published; default: hash them now.
    """
    path = Path(artifact)
    if files is None:
        root, paths = _artifact_files(path, companions)
        files = _file_entries(root, paths)
    data: dict[str, Any] = {
        "schema": MANIFEST_SCHEMA,
        "target": target,
        "variant": variant,
        "artifact": {"name": name or path.name, "kind": "directory" if path.is_dir() else "file"},
        "options": json_safe(dict(options)),
        "versions": versions(runtime_library),
        "inputs": json_safe(list(inputs)),
        "tolerance": json_safe(dict(tolerance)),
        "model_blake3": model_hash,
        "vocab_size": vocab_size,
        "files": {name: dict(entry) for name, entry in sorted(files.items())},
    }
    signature = trustkey.sign(_canonical(data))
    if signature is not None:
        data["hmac"] = signature
    destination = manifest_path(path)
    write_bytes_atomic(destination, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())
    return destination


def read_manifest(artifact: str | os.PathLike[str]) -> Manifest | None:
    """The artifact's manifest, or ``None`` when it has none.

    Warns :class:`NewerManifestWarning` for a newer schema (read as far as this
    schema goes).

    Raises:
        ManifestSchemaError: the manifest is not JSON, has no integer schema, or a
            schema this exportlm does not know (older than 1), or lacks required fields.
        NotRegularFileError: a FIFO, device or directory stands where the manifest should
            be (refused before anything is read, so it cannot block).
    """
    path = manifest_path(artifact)
    try:
        raw = read_regular_bytes(path, what="manifest", max_bytes=_MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestSchemaError(
            f"manifest {path} is not valid UTF-8 JSON ({err}); it may be truncated or tampered "
            "with. Re-export the artifact (which rewrites the manifest), or delete the manifest "
            "to load the artifact as unverified.",
            path,
        ) from err
    schema = data.get("schema") if isinstance(data, dict) else None
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise ManifestSchemaError(
            f"manifest {path} has schema {schema!r}; this exportlm reads integer schemas "
            f"1..{MANIFEST_SCHEMA}. Re-export the artifact, or delete the manifest to load it "
            "as unverified.",
            path,
        )
    if schema > MANIFEST_SCHEMA:
        warnings.warn(
            f"manifest {path} has schema {schema}, newer than this exportlm's "
            f"{MANIFEST_SCHEMA}: fields it adds are not checked. Upgrade exportlm.",
            NewerManifestWarning,
            stacklevel=2,
        )
    return _parse(path, schema, data)


def _parse(path: Path, schema: int, data: dict[str, Any]) -> Manifest:
    files = data.get("files")
    target = data.get("target")
    if not isinstance(files, dict) or not isinstance(target, str) or not files:
        raise ManifestSchemaError(
            f"manifest {path} lacks its 'target' or 'files' fields; re-export the artifact",
            path,
        )
    vocab = data.get("vocab_size")
    name, kind = _artifact_field(path, schema, data)
    return Manifest(
        path=path,
        schema=schema,
        target=target,
        variant=data.get("variant"),
        options=data.get("options") or {},
        versions=data.get("versions") or {},
        inputs=data.get("inputs") or [],
        tolerance=data.get("tolerance") or {},
        model_hash=data.get("model_blake3" if schema >= 3 else "model_sha256"),
        vocab_size=vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None,
        files=files,
        artifact_name=name,
        artifact_kind=kind,
        data=data,
    )


def _artifact_field(
    path: Path, schema: int, data: Mapping[str, Any]
) -> tuple[str | None, str | None]:
    """(name, kind) of the artifact the manifest was written for; required from schema 2."""
    field_ = data.get("artifact")
    name = field_.get("name") if isinstance(field_, dict) else None
    kind = field_.get("kind") if isinstance(field_, dict) else None
    if isinstance(name, str) and kind in ("file", "directory"):
        return name, kind
    if schema >= 2:
        raise ManifestSchemaError(
            f"manifest {path} (schema {schema}) has no valid 'artifact' field naming the file or "
            "directory it was written for; it is malformed or tampered with. Re-export the "
            "artifact.",
            path,
        )
    return None, None


def verify_artifact(
    artifact: str | os.PathLike[str],
    *,
    manifest: Manifest | None = None,
    held: VerifiedFile | None = None,
) -> Manifest:
    """Check ``artifact`` against its manifest: it is the manifest's artifact, byte for byte.

    ``manifest``: the one already read (default: read it now). ``held``: the artifact
    file, opened and hashed once (:func:`~exportlm.export._verified.hold`); its digest
    is what is checked, so the bytes checked are the bytes a loader reads from it.

    Raises:
        ArtifactIntegrityError: the artifact has no manifest, or the manifest was written
            for another artifact (another file name, or a file where it names a
            directory), or a listed file is missing or differs (digest or size), a listed
            name leaves the artifact's directory, or a directory artifact holds a file the
            manifest does not list. The message names the file.
        ManifestSchemaError: the manifest itself is unreadable (see :func:`read_manifest`).
    """
    path = Path(artifact)
    manifest = manifest if manifest is not None else read_manifest(path)
    if manifest is None:
        raise ArtifactIntegrityError(
            f"{path} has no manifest ({manifest_path(path)}); nothing to verify it against. "
            "Re-export it with exportlm to get one.",
            manifest_path(path),
        )
    directory = held is None and path.is_dir()
    _check_binding(manifest, path, "directory" if directory else "file")
    root = path if directory else path.parent
    for name, entry in sorted(manifest.files.items()):
        if held is not None and name == path.name:
            actual = (held.digest, held.size, held.algorithm)
            check_entry(path, entry, actual, manifest.digest, manifest.path)
        else:
            verify_listed(root, name, entry, manifest.digest, manifest.path)
    if directory:
        _refuse_unlisted(path, manifest)
    return manifest


def _check_binding(manifest: Manifest, path: Path, kind: str) -> None:
    """The manifest vouches for exactly one artifact: ``path`` must be it (name and kind)."""
    if manifest.artifact_kind is not None and manifest.artifact_kind != kind:
        raise ArtifactIntegrityError(
            f"manifest {manifest.path} was written for a {manifest.artifact_kind} artifact, but "
            f"{path} is a {kind}: it proves nothing about {path}. Re-export the artifact.",
            manifest.path,
        )
    if kind == "directory":
        return  # inside the directory, listing every file in it: the content is bound
    expected = manifest.artifact_name or ", ".join(sorted(manifest.files))
    if path.name in manifest.files and manifest.artifact_name in (None, path.name):
        return
    raise ArtifactIntegrityError(
        f"manifest {manifest.path} vouches for {expected!r}, not for {path.name!r}: a manifest "
        f"covers exactly the one artifact it was written for, so it proves nothing about {path}. "
        "If you renamed the artifact, rename it and its manifest back, or re-export it; if "
        f"{path.name} came from elsewhere, delete {manifest.path.name} and load it as unverified "
        "(with trust=True for a format that executes code) only if you trust its origin.",
        path,
    )


def _refuse_unlisted(directory: Path, manifest: Manifest) -> None:
    listed = set(manifest.files)
    for extra in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = extra.relative_to(directory).as_posix()
        if relative != DIRECTORY_MANIFEST_NAME and relative not in listed:
            raise ArtifactIntegrityError(
                f"{extra} is not listed in the manifest {manifest.path}: the directory was "
                "changed after export. Remove the file or re-export the artifact.",
                extra,
            )
