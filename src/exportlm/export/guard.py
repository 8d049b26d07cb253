"""The trust boundary and the manifest of every export: what export and load do around a target.

* :class:`PendingManifest`: the manifest (:mod:`~exportlm.export.manifest`) of one export,
  made once by the export job. The job hands :meth:`PendingManifest.hook` to
  :func:`~exportlm.atomic.atomic_output`, which writes it into the staging area just before
  publishing, so it is published last and a complete manifest means a complete artifact.
  A target that hashed its files as it wrote them records those digests
  (:meth:`PendingManifest.record_files`) and may start the model's hash on worker threads
  while it exports (:meth:`PendingManifest.hash_model_in_background`): then nothing is
  read again to write the manifest.
  Around a factory that exportlm does not run, :meth:`PendingManifest.finish` writes it
  after the factory returns.
* :func:`verified_load`: around a runtime loader, opens the artifact file once, verifies
  those bytes against its manifest (always, ``trust`` or not: it must be the manifest's
  own artifact, by name, and match it byte for byte), refuses a code-executing format
  whose manifest does not vouch for it (signed by this user's key, for this target)
  unless ``trust=True``, and serves the verified bytes to the loader
  (:func:`open_artifact`), so no path is resolved again between the check and the load.
* :func:`check_real_weights`: a model on the ``meta`` device has nothing to export.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exportlm.errors import InvalidModelError, ManifestSchemaError, UntrustedArtifactError
from exportlm.export._digest import DIGEST, file_digest
from exportlm.export._manifest_data import (
    HASH_THREADS,
    ModelHashFuture,
    model_hash_future,
    model_hash_wanted,
)
from exportlm.export._verified import VerifiedFile, hold, open_artifact, serving
from exportlm.export.declaration import TargetInfo
from exportlm.export.manifest import (
    DIRECTORY_MANIFEST_NAME,
    MANIFEST_SUFFIX,
    Manifest,
    model_hash,
    read_manifest,
    verify_artifact,
)
from exportlm.export.manifest import write_manifest as _write_manifest

__all__ = [
    "TRUST_HINT",
    "PendingManifest",
    "UnverifiedArtifactWarning",
    "check_real_weights",
    "open_artifact",
    "verified_load",
]

TRUST_HINT = "pass trust=True to load_exported (exportlm CLI: --trust)"


class UnverifiedArtifactWarning(UserWarning):
    """Loaded bytes that nothing verified: no manifest, or a runtime that reopened the path."""


def check_real_weights(model: Any, target: str) -> None:
    """Refuse a model with parameters or buffers on the ``meta`` device (no data to export)."""
    tensors = [*getattr(model, "parameters", list)(), *getattr(model, "buffers", list)()]
    meta = [t for t in tensors if getattr(t, "is_meta", False)]
    if meta:
        raise InvalidModelError(
            f"export target {target!r}: {type(model).__name__} has {len(meta)} of "
            f"{len(tensors)} tensors on the 'meta' device, which hold no weights; the artifact "
            "would have none. Load real weights first (e.g. model.to_empty(device='cpu') then "
            "load_state_dict, or from_pretrained without a meta device_map)."
        )


def _variant(info: TargetInfo, options: Mapping[str, Any]) -> str | None:
    for name, values in sorted(info.variants.items()):
        if all(options.get(k, _MISSING) == v for k, v in values.items()):
            return name
    return None


_MISSING = object()


def _graph_inputs(artifact: Path) -> list[dict[str, Any]] | None:
    """Every input of an ONNX graph (name, dtype, dims: a name for a dynamic one), or ``None``.

    Read from the graph itself (weights kept external), so the manifest lists what the
    graph really takes: ``input_ids``, ``attention_mask``, ``position_ids``,
    ``past_key_values.*``. ``None`` for anything else, or where onnx is not installed.
    """
    if artifact.suffix != ".onnx" or not artifact.is_file():
        return None
    try:
        import onnx
        from onnx import helper
    except ImportError:
        return None
    graph = onnx.load(str(artifact), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    found = []
    for value in graph.input:
        if value.name in weights:  # an initializer listed as an input (old opsets)
            continue
        tensor = value.type.tensor_type
        dims: list[Any] = [d.dim_param or d.dim_value for d in tensor.shape.dim]
        dtype = str(helper.tensor_dtype_to_np_dtype(tensor.elem_type))
        found.append({"name": value.name, "dtype": dtype, "shape": dims})
    return found


def _inputs(
    info: TargetInfo, options: Mapping[str, Any], artifact: Path | None = None
) -> list[dict[str, Any]]:
    """Input names and dims: names for dynamic dims, sizes for a static export.

    For an ONNX graph, every graph input as the graph declares it (:func:`_graph_inputs`).
    """
    graph = _graph_inputs(artifact) if artifact is not None else None
    if graph:
        return graph
    shape: list[Any] = ["batch", "sequence"]
    example = options.get("example_inputs")
    if options.get("dynamic") is False or not (
        info.has("dynamic_shapes") or info.artifact == "directory"
    ):
        ids = example[0] if isinstance(example, (tuple, list)) and example else example
        shape = list(getattr(ids, "shape", [])) or ["batch", "sequence"]
    return [{"name": "input_ids", "dtype": "int64", "shape": shape}]


#: What identifies one written manifest file: a rewrite is a new file (``os.replace``).
_Stamp = tuple[int, int, int, int]


def _stamp(path: Path) -> _Stamp | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _manifest_locations(destination: Path) -> tuple[Path, Path]:
    """Where the manifest of ``destination`` lives as a file artifact and as a directory one."""
    return (
        destination.with_name(destination.name + MANIFEST_SUFFIX),
        destination / DIRECTORY_MANIFEST_NAME,
    )


@dataclass
class PendingManifest:
    """The manifest of one export, not yet written; see the module docstring.

    Attributes:
        info: the target, as registered (its name is the manifest's ``target``).
        model: hashed when the manifest is written, so a failing export reads no weight first.
        options: the options the manifest records.
        vocab_size: the model's vocabulary (``None`` when it cannot be told).
        destination: the absolute path the artifact is published at.
    """

    info: TargetInfo
    model: Any
    options: Mapping[str, Any]
    vocab_size: int | None
    destination: Path
    written: bool = False
    _before: dict[Path, _Stamp | None] = field(default_factory=dict, repr=False)
    _recorded: dict[str, Mapping[str, Any]] = field(default_factory=dict, repr=False)
    _model_hash: ModelHashFuture | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._before = {p: _stamp(p) for p in _manifest_locations(self.destination)}

    def hash_model_in_background(self, threads: int = HASH_THREADS) -> None:
        """Start :func:`model_hash` of the model on ``threads`` workers; the manifest waits for it.

        For a target whose export reads every weight anyway: the hash then runs while it
        converts and writes, instead of after. Call it once the export's checks passed.
        Nothing is hashed unless :data:`~exportlm.export._manifest_data.MODEL_HASH_ENV` is set.
        """
        if self._model_hash is None and hasattr(self.model, "state_dict") and model_hash_wanted():
            self._model_hash = model_hash_future(self.model, threads=threads)

    def cancel_model_hash(self) -> None:
        """The export failed: stop hashing the model (see :meth:`hash_model_in_background`)."""
        if self._model_hash is not None:
            self._model_hash.cancel()

    def record_files(self, digests: Mapping[str, Mapping[str, Any]]) -> None:
        """The ``{"blake3", "size"}`` of files of a staged directory, hashed as they were written.

        Names are relative to the directory. The manifest lists them without reading them
        again (a recorded file whose size differs by then is hashed anew); any file of the
        directory that nobody recorded, or recorded without a BLAKE3 digest, is hashed when
        the manifest is written.
        """
        self._recorded.update({name: dict(entry) for name, entry in digests.items()})

    def write(
        self,
        artifact: Path,
        companions: Sequence[Path] = (),
        files: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Path:
        """Write the manifest of ``artifact`` (staged or final), naming the published artifact."""
        self.written = True
        return _write_manifest(
            artifact,
            target=self.info.name,
            variant=_variant(self.info, self.options),
            options=self.options,
            tolerance={"atol": self.info.atol, "rtol": self.info.rtol},
            model_hash=self._hash_of_model(),
            inputs=_inputs(self.info, self.options, artifact),
            runtime_library=self.info.runtime_library,
            vocab_size=self.vocab_size,
            companions=companions,
            name=self.destination.name,
            files=files,
        )

    def hook(self, staged: Path, destination: Path) -> Sequence[Path]:
        """``atomic_output``'s ``before_publish``: the manifest of the staged artifact."""
        del destination  # the job staged exactly this export's destination
        if self.written:
            return []
        if staged.is_dir():
            self.write(staged, files=self._directory_files(staged))
            return []
        companions = [p for p in staged.parent.iterdir() if p != staged and p.is_file()]
        return [self.write(staged, companions)]

    def _hash_of_model(self) -> str | None:
        if self._model_hash is not None:
            return self._model_hash()
        if not hasattr(self.model, "state_dict") or not model_hash_wanted():
            return None
        return model_hash(self.model, threads=HASH_THREADS)

    def _directory_files(self, staged: Path) -> dict[str, Mapping[str, Any]]:
        """Every file of ``staged``: as recorded when its size still agrees, else hashed now."""
        entries: dict[str, Mapping[str, Any]] = {}
        for path in sorted(p for p in staged.rglob("*") if p.is_file()):
            name = path.relative_to(staged).as_posix()
            if name == DIRECTORY_MANIFEST_NAME:
                continue
            size = path.stat().st_size
            entry = self._recorded.get(name)
            if entry is None or entry.get("size") != size or DIGEST not in entry:
                entry = {DIGEST: file_digest(path), "size": size}
            entries[name] = entry
        return entries

    def finish(self, artifact: Path) -> None:
        """After a factory exportlm did not run: write the manifest of what it left at ``artifact``.

        A factory may itself call one of exportlm's writers (a built-in target, whose job
        wrote a manifest when it published). A manifest written during this export for
        this very artifact keeps the files it lists, as hashed when they were published,
        and is re-signed for this target; otherwise the files are hashed now.
        """
        if self.written or not artifact.exists():
            return
        self.write(artifact, files=self._fresh_files(artifact))

    def _fresh_files(self, artifact: Path) -> Mapping[str, Mapping[str, Any]] | None:
        path = _manifest_locations(self.destination)[1 if artifact.is_dir() else 0]
        if _stamp(path) in (None, self._before.get(path)):
            return None
        try:
            manifest = read_manifest(artifact)
        except ManifestSchemaError:
            return None
        if manifest is None or manifest.artifact_name != self.destination.name:
            return None
        return manifest.files


@contextlib.contextmanager
def verified_load(info: TargetInfo, path: Path, *, trust: bool) -> Iterator[Manifest | None]:
    """Verify ``path`` and apply the trust boundary; inside, the loader reads what was verified.

    A file artifact is opened once (:func:`~exportlm.export._verified.hold`) and its
    digest checked from that descriptor; :func:`open_artifact` hands the loader that
    same file (or a private copy made while hashing) until the context ends. Yields the
    manifest (``None`` when there is none, or nothing is at ``path``).

    Raises:
        ArtifactIntegrityError: the manifest was written for another artifact, or a file
            differs from, is missing from or is extra to it (checked with ``trust=True``
            too: trust waives the origin proof, never the integrity check).
        ManifestSchemaError: the manifest is unreadable or of an unknown schema.
        UntrustedArtifactError: the format can execute code, ``trust`` is false, and the
            manifest does not vouch for the artifact (see :func:`_not_vouched`).
        NotRegularFileError: a file artifact's path is a FIFO, device or directory.
    """
    if not os.path.lexists(path):
        yield None  # the loader says what is missing
        return
    manifest = read_manifest(path)
    if manifest is None:
        if info.executes_code and not trust:
            raise _untrusted(info, path, "it has no manifest")
        warnings.warn(
            f"{path} has no exportlm manifest: its files are loaded unverified. Re-export it "
            "with exportlm to get one.",
            UnverifiedArtifactWarning,
            stacklevel=3,
        )
        yield None
        return
    held: list[VerifiedFile] = []
    if info.artifact == "file":
        what, copy = f"{info.name} artifact", info.executes_code
        held.append(hold(path, what=what, copy_if_shared=copy, algorithm=manifest.digest))
    with serving(held) as served:
        verify_artifact(path, manifest=manifest, held=held[0] if held else None)
        _check_origin(info, path, manifest, trust)
        yield manifest
        if held and info.executes_code and not served:
            warnings.warn(
                f"the runtime of target {info.name!r} opened {path} itself, not through "
                "exportlm.export.guard.open_artifact: the bytes it loaded are not necessarily "
                "the ones verified (a path swapped in between is not detected). Its author "
                "should open the artifact with open_artifact (see docs/security.md).",
                UnverifiedArtifactWarning,
                stacklevel=3,
            )


def _check_origin(info: TargetInfo, path: Path, manifest: Manifest, trust: bool) -> None:
    why = _not_vouched(info, manifest)
    if why is None:
        return
    if info.executes_code and not trust:
        raise _untrusted(info, path, why)
    if manifest.target != info.name:
        warnings.warn(
            f"{path} was exported with target {manifest.target!r} and is loaded as {info.name!r}",
            UserWarning,
            stacklevel=4,
        )


def _not_vouched(info: TargetInfo, manifest: Manifest) -> str | None:
    """Why the (verified) manifest does not vouch for the artifact's origin; ``None`` if it does."""
    if manifest.target != info.name:
        return (
            f"its manifest was written for target {manifest.target!r}, not {info.name!r} "
            "(re-export it with this target)"
        )
    if manifest.artifact_name is None:
        return (
            f"its manifest (schema {manifest.schema}) does not name the artifact it was written "
            "for, so it cannot vouch for this one (re-export it with this exportlm)"
        )
    if not manifest.is_own():
        return "its manifest is not signed by this machine's exportlm key"
    return None


def _untrusted(info: TargetInfo, path: Path, why: str) -> UntrustedArtifactError:
    return UntrustedArtifactError(
        f"refusing to load {path}: the {info.name!r} format can execute arbitrary code when "
        f"loaded (unpickling / TorchScript), and {why}, so nothing proves it was written here. "
        f"If you trust its origin, {TRUST_HINT}. See docs/security.md."
    )
