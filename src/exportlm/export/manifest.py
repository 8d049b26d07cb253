"""The manifest beside every artifact: what it is, what made it, and the sha256 of every file.

Where it lives (:func:`manifest_path`):

* a file artifact ``out/model.onnx`` -> ``out/model.onnx.manifest.json`` (a sibling);
* a directory artifact ``out/ckpt/`` -> ``out/ckpt/exportlm-manifest.json`` (inside, so it
  is swapped in together with the directory).

What it holds (schema :data:`MANIFEST_SCHEMA`): the target and variant, the options
(JSON-safe), versions of exportlm / torch / transformers / the target's runtime library,
the input names with their dims (names for dynamic ones), the declared tolerance, a
sha256 of the model's structure and weights (:func:`model_hash`: the exact bytes, no
float comparison), the sha256 and size of every file of the artifact, the vocabulary
size where known, and an HMAC-SHA256 under this user's key
(:mod:`~exportlm.export.trustkey`).

What it proves: with :func:`verify_artifact` passing, the files are byte for byte the
ones the manifest lists; with :meth:`Manifest.is_own` too, the manifest (and so the
files) was written by exportlm under this user's key on this machine. It does not
prove the model is benign, nor anything about an artifact whose manifest is unsigned
or signed elsewhere: anyone can write a manifest with matching hashes.

The manifest is written last: a complete manifest means a complete artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from exportlm.errors import ArtifactIntegrityError, ManifestSchemaError
from exportlm.export import trustkey

__all__ = [
    "DIRECTORY_MANIFEST_NAME",
    "MANIFEST_SCHEMA",
    "MANIFEST_SUFFIX",
    "Manifest",
    "NewerManifestWarning",
    "json_safe",
    "manifest_path",
    "model_hash",
    "read_manifest",
    "verify_artifact",
    "write_manifest",
]

#: Schema version written by this exportlm. A reader warns on a newer one, refuses an unknown one.
MANIFEST_SCHEMA = 1
MANIFEST_SUFFIX = ".manifest.json"
DIRECTORY_MANIFEST_NAME = "exportlm-manifest.json"
_CHUNK = 1 << 20


class NewerManifestWarning(UserWarning):
    """The manifest's schema is newer than this exportlm's: fields it adds are not checked."""


def manifest_path(artifact: str | os.PathLike[str]) -> Path:
    """``<artifact>.manifest.json`` for a file, ``<dir>/exportlm-manifest.json`` for a directory."""
    path = Path(artifact)
    if path.is_dir():
        return path / DIRECTORY_MANIFEST_NAME
    return path.with_name(path.name + MANIFEST_SUFFIX)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def model_hash(model: Any) -> str:
    """sha256 of ``model``'s structure and weights: class, then every state-dict entry in name order.

    Each entry contributes its name, dtype, shape and raw bytes (exact: no float is
    compared, the bytes are hashed), so the same weights give the same hash on any
    machine. Tensors are read on the CPU; a model on the ``meta`` device has no
    bytes and must be refused before this is called.
    """
    digest = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}\n".encode())
    state = model.state_dict()
    for name in sorted(state):
        if not hasattr(state[name], "detach"):  # an extra state that is not a tensor
            digest.update(f"{name}|{state[name]!r}\n".encode())
            continue
        tensor = state[name].detach()
        header = f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}\n"
        digest.update(header.encode())
        if tensor.numel():
            flat = tensor.cpu().contiguous().reshape(-1)
            digest.update(flat.view(_uint8()).numpy().tobytes())
    return digest.hexdigest()


def _uint8() -> Any:
    import torch

    return torch.uint8


def json_safe(value: Any) -> Any:
    """``value`` as JSON data: tensors become ``{"tensor": shape, "dtype": ...}``, paths and dtypes strings."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return {"tensor": list(shape), "dtype": str(dtype).removeprefix("torch.")}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value).removeprefix("torch.")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


#: The library each built-in runtime loads with.
_RUNTIME_LIBRARY = {
    "onnx": "onnxruntime",
    "torchscript": "torch",
    "torch_export": "torch",
    "hf_checkpoint": "safetensors",
}


def _versions(runtime: str | None) -> dict[str, str | None]:
    versions = {name: _version(name) for name in ("exportlm", "torch", "transformers")}
    library = _RUNTIME_LIBRARY.get(runtime or "")
    if library is not None:
        versions[f"runtime:{library}"] = _version(library)
    return versions


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest (see the module docstring).

    Attributes:
        path: where it was read from.
        schema: its schema version.
        target, variant, options, versions, inputs, tolerance, model_hash, vocab_size:
            as written.
        files: ``{relative path: {"sha256": hex, "size": bytes}}``; relative to the
            artifact's directory (a directory artifact) or its parent (a file artifact).
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
    data: Mapping[str, Any] = field(repr=False)

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
            "sha256": file_sha256(path),
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
    runtime: str | None = None,
    vocab_size: int | None = None,
    companions: Sequence[Path] = (),
) -> Path:
    """Hash the artifact's files and write its signed manifest atomically; returns the manifest path.

    Args:
        artifact: the artifact file or directory, complete (its files are hashed now).
        target, variant: the export target's name and the variant exported (or ``None``).
        options: the target options (made JSON-safe with :func:`json_safe`).
        tolerance: ``{"atol": ..., "rtol": ...}`` the target declares.
        model_hash: :func:`model_hash` of the exported model (``None`` if unknown).
        inputs: ``[{"name", "dtype", "shape"}]``; a dynamic dim is a name (``"batch"``).
        runtime: the runtime's name, to record its library's version.
        vocab_size: the vocabulary, when known: runtimes refuse ids outside it.
        companions: further files of a file artifact (e.g. ONNX external data).
    """
    from exportlm.atomic import write_bytes_atomic

    path = Path(artifact)
    root, files = _artifact_files(path, companions)
    data: dict[str, Any] = {
        "schema": MANIFEST_SCHEMA,
        "target": target,
        "variant": variant,
        "artifact": {"name": path.name, "kind": "directory" if path.is_dir() else "file"},
        "options": json_safe(dict(options)),
        "versions": _versions(runtime),
        "inputs": json_safe(list(inputs)),
        "tolerance": json_safe(dict(tolerance)),
        "model_sha256": model_hash,
        "vocab_size": vocab_size,
        "files": _file_entries(root, files),
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
    """
    path = manifest_path(artifact)
    try:
        raw = path.read_bytes()
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
    return Manifest(
        path=path,
        schema=schema,
        target=target,
        variant=data.get("variant"),
        options=data.get("options") or {},
        versions=data.get("versions") or {},
        inputs=data.get("inputs") or [],
        tolerance=data.get("tolerance") or {},
        model_hash=data.get("model_sha256"),
        vocab_size=vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None,
        files=files,
        data=data,
    )


def verify_artifact(artifact: str | os.PathLike[str]) -> Manifest:
    """Check every file of ``artifact`` against its manifest; returns the manifest.

    Raises:
        ArtifactIntegrityError: the artifact has no manifest, a listed file is missing
            or differs (sha256 or size), a listed name leaves the artifact's directory,
            or a directory artifact holds a file the manifest does not list. The message
            names the file.
        ManifestSchemaError: the manifest itself is unreadable (see :func:`read_manifest`).
    """
    path = Path(artifact)
    manifest = read_manifest(path)
    if manifest is None:
        raise ArtifactIntegrityError(
            f"{path} has no manifest ({manifest_path(path)}); nothing to verify it against. "
            "Re-export it with exportlm to get one.",
            manifest_path(path),
        )
    root = path if path.is_dir() else path.parent
    for name, entry in sorted(manifest.files.items()):
        _verify_file(root, name, entry, manifest.path)
    if path.is_dir():
        listed = set(manifest.files)
        for extra in sorted(p for p in path.rglob("*") if p.is_file()):
            relative = extra.relative_to(path).as_posix()
            if relative != DIRECTORY_MANIFEST_NAME and relative not in listed:
                raise ArtifactIntegrityError(
                    f"{extra} is not listed in the manifest {manifest.path}: the directory was "
                    "changed after export. Remove the file or re-export the artifact.",
                    extra,
                )
    return manifest


def _verify_file(root: Path, name: str, entry: Any, manifest: Path) -> None:
    candidate = (root / name).resolve()
    if not isinstance(entry, Mapping) or not candidate.is_relative_to(root.resolve()):
        raise ArtifactIntegrityError(
            f"manifest {manifest} lists {name!r}, which is not a file inside {root}; the "
            "manifest is malformed or tampered with. Re-export the artifact.",
            root / name,
        )
    file = root / name
    if not file.is_file():
        raise ArtifactIntegrityError(
            f"{file} is listed in the manifest {manifest} but missing; the artifact is "
            "incomplete. Re-export it.",
            file,
        )
    if file.stat().st_size != entry.get("size") or file_sha256(file) != entry.get("sha256"):
        raise ArtifactIntegrityError(
            f"{file} does not match its sha256 in the manifest {manifest}: it was changed or "
            "replaced after export. It is not loaded; re-export the artifact from its model.",
            file,
        )
