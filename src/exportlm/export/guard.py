"""The trust boundary and the manifest of every export: what export and load do around a target.

* :func:`manifest_for_export`: around an export, writes the artifact's manifest
  (:mod:`~exportlm.export.manifest`) into the staging area just before it is published
  (:func:`~exportlm.atomic.before_publish`), so it is published last and a complete
  manifest means a complete artifact. A target that does not stage through
  :func:`~exportlm.atomic.atomic_output` gets its manifest written after it returns.
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
import contextvars
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exportlm.atomic import before_publish
from exportlm.errors import InvalidModelError, UntrustedArtifactError
from exportlm.export._verified import VerifiedFile, hold, open_artifact, serving
from exportlm.export.manifest import Manifest, model_hash, read_manifest, verify_artifact
from exportlm.export.manifest import write_manifest as _write_manifest

if TYPE_CHECKING:
    from exportlm.export.targets import TargetInfo

__all__ = [
    "TRUST_HINT",
    "UnverifiedArtifactWarning",
    "check_real_weights",
    "finish_manifest",
    "manifest_for_export",
    "open_artifact",
    "verified_load",
]

TRUST_HINT = "pass trust=True to load_exported (exportlm CLI: --trust)"

_ACTIVE: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "exportlm_manifest_destinations", default=frozenset()
)


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


def _inputs(info: TargetInfo, options: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Input names and dims: names for dynamic dims, sizes for a static export."""
    shape: list[Any] = ["batch", "sequence"]
    example = options.get("example_inputs")
    if options.get("dynamic") is False or not (
        info.has("dynamic_shapes") or info.artifact == "directory"
    ):
        ids = example[0] if isinstance(example, (tuple, list)) and example else example
        shape = list(getattr(ids, "shape", [])) or ["batch", "sequence"]
    return [{"name": "input_ids", "dtype": "int64", "shape": shape}]


def _vocab_size(model: Any) -> int | None:
    from exportlm.inputs import infer_vocab_size

    try:
        return infer_vocab_size(model)
    except Exception:  # any model: an unknown vocabulary is simply not recorded
        return None


@dataclass
class _Request:
    info: TargetInfo
    model: Any  # hashed when the manifest is written: a failing export reads no weight first
    options: Mapping[str, Any]
    vocab_size: int | None
    destination: Path
    written: bool = False

    def write(self, artifact: Path, companions: Sequence[Path] = ()) -> Path:
        """Write the manifest of ``artifact`` (staged or final), naming the published artifact."""
        self.written = True
        return _write_manifest(
            artifact,
            target=self.info.name,
            variant=_variant(self.info, self.options),
            options=self.options,
            tolerance={"atol": self.info.atol, "rtol": self.info.rtol},
            model_hash=model_hash(self.model) if hasattr(self.model, "state_dict") else None,
            inputs=_inputs(self.info, self.options),
            runtime=self.info.runtime,
            vocab_size=self.vocab_size,
            companions=companions,
            name=self.destination.name,
        )

    def hook(self, staged: Path, destination: Path) -> Sequence[Path]:
        if self.written or os.path.abspath(destination) != str(self.destination):
            return []
        if staged.is_dir():
            self.write(staged)
            return []
        companions = [p for p in staged.parent.iterdir() if p != staged and p.is_file()]
        return [self.write(staged, companions)]


@contextlib.contextmanager
def manifest_for_export(
    info: TargetInfo, model: Any, output_path: str | os.PathLike[str], options: Mapping[str, Any]
) -> Iterator[_Request | None]:
    """Write the manifest of the artifact exported inside this context (see the module docstring).

    Nested contexts for the same destination write one manifest (the outermost's).
    Yields the pending request, or ``None`` when an outer context owns it; the caller
    passes the written artifact to :func:`finish_manifest`.
    """
    destination = os.path.abspath(output_path)
    if destination in _ACTIVE.get():
        yield None
        return
    check_real_weights(model, info.name)
    request = _Request(
        info=info,
        model=model,
        options=dict(options),
        vocab_size=_vocab_size(model),
        destination=Path(destination),
    )
    token = _ACTIVE.set(_ACTIVE.get() | {destination})
    try:
        with before_publish(request.hook):
            yield request
    finally:
        _ACTIVE.reset(token)


def finish_manifest(request: _Request | None, artifact: Path) -> None:
    """Write the manifest after the fact for a target that did not stage through ``atomic_output``."""
    if request is not None and not request.written and artifact.exists():
        request.write(artifact)


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
        held.append(hold(path, what=f"{info.name} artifact", copy_if_shared=info.executes_code))
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
