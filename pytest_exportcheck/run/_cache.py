"""The artifact cache behind ``TargetCase.export``: in session, and across runs on disk.

An artifact is keyed by everything that can change it: target, variant and extra
export kwargs, model family and seed (or, for a model a check built itself, its
class), a fingerprint of the built model (class, config, state-dict names,
shapes, dtypes and bytes, each quantizer's settings: its format), the source of the package that provides the target
and of the one that defines the model's class (unless a versioned library
below), and the versions of Python, exportlm, torch, transformers, onnx,
onnxruntime and onnxscript, and of the target's distribution with everything it
requires (:mod:`._versions`, the one computation the failure memo's key shares).

The export runs into an empty directory, which must afterwards hold the
returned artifact (and whatever it wrote next to it): a returned path that does
not exist or lies elsewhere fails with :class:`ArtifactPathError`.

Layout: ``<root>/<key>/`` holds ``meta.json`` and ``out/<artifact>`` (plus whatever
the target writes beside it, e.g. ONNX external data, and the artifact's manifest).
An entry is built in a temporary sibling and published with one ``os.replace`` of
the directory, so a reader never sees half an entry; two xdist workers that race
on a key serialize on a lock file where ``fcntl`` exists, and otherwise the loser
discards its copy. Cached files are made read-only: checks must copy before they
modify.

The cache is data, not code (:mod:`._cache_entry`): ``meta.json`` carries the
sha256 of every file of the entry, its own key and this user's HMAC signature, and an
entry is used only when it verifies under the key it is read for, its paths stay inside it and, for a target whose
format executes code on load, the artifact's manifest is this machine's own. An
entry that fails is evicted and rebuilt with an :class:`ExportCheckWarning`,
never loaded and never counted against the target. Staging directories that
dead writers left behind are removed when the cache is opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exportlm.errors import ExportError, UnsafeLockFileError
from exportlm.safeio import exclusive_lock
from pytest_exportcheck._warnings import ExportCheckWarning
from pytest_exportcheck.run._cache_entry import (
    UnsoundEntryError,
    evict,
    read_entry,
    sweep_dead_writers,
    write_meta,
)
from pytest_exportcheck.run._versions import VERSIONED, factory_versions, version_of
from pytest_exportcheck.run._versions import library_versions as library_versions

if TYPE_CHECKING:
    from pytest_exportcheck.checks._registries import Registries

__all__ = [
    "ArtifactCache",
    "ArtifactPathError",
    "code_digest",
    "model_fingerprint",
    "source_digest",
]

logger = logging.getLogger(__name__)

#: Bump when the layout or the key changes. 4: ``meta.json`` carries its own key.
#: 5: the key holds the versions of everything the target's distribution requires.
CACHE_FORMAT = 5
_KEY_LENGTH = 32


class ArtifactPathError(ExportError):
    """An export returned a path that does not exist or is not in its output directory."""


@cache
def source_digest(module_name: str) -> str:
    """sha256 over the ``.py`` files of the top-level package that defines ``module_name``.

    Editing a target's code (or anything else in its package) invalidates its
    cached artifacts, even in an editable install whose version never changes.
    """
    top = module_name.split(".", 1)[0]
    module = sys.modules.get(top)
    digest = hashlib.sha256(top.encode())
    location = getattr(module, "__file__", None)
    if location is None:
        return digest.hexdigest()
    path = Path(location)
    files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
    for file in files:
        digest.update(str(file.relative_to(path.parent)).encode())
        with contextlib.suppress(OSError):
            digest.update(file.read_bytes())
    return digest.hexdigest()


def model_fingerprint(model: Any) -> str:
    """sha256 of a model's class, config, state dict (names, shapes, dtypes, bytes) and
    its quantizers' settings (:func:`_settings`)."""
    import torch

    digest = hashlib.sha256()
    cls = type(model)
    digest.update(f"{cls.__module__}.{cls.__qualname__}".encode())
    config = getattr(model, "config", None)
    if config is not None:
        to_json = getattr(config, "to_json_string", None)
        text = to_json(use_diff=False) if callable(to_json) else repr(config)
        digest.update(text.encode())
    for name, tensor in model.state_dict().items():
        host = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{tuple(host.shape)}:{host.dtype}".encode())
        digest.update(host.reshape(-1).view(torch.uint8).numpy().tobytes())
    from exportlm.quant import TensorQuantizer

    modules = model.named_modules() if isinstance(model, torch.nn.Module) else ()
    for name, module in modules:
        if isinstance(module, TensorQuantizer):  # an unquantized model's key is as it was
            digest.update(f"{name}:{_settings(module)}".encode())
    return digest.hexdigest()


def _settings(quantizer: Any) -> str:
    """A quantizer's ``extra_repr`` and plain attributes: equal state dicts may hold other
    formats (``fp8_dynamic`` and ``int8_wo`` store the same per-row amaxes)."""
    import torch

    plain = (str, int, float, bool, type(None), torch.dtype)
    own = {k: v for k, v in sorted(vars(quantizer).items()) if k[0] != "_" and isinstance(v, plain)}
    return f"{quantizer.extra_repr()}{own!r}"


def code_digest(cls: type) -> str:
    """:func:`source_digest` of the package defining ``cls``; its version for a versioned library."""
    top = cls.__module__.split(".", 1)[0]
    if top in VERSIONED and top != "exportlm":
        return f"{top}=={version_of(top)}"
    return source_digest(cls.__module__)


def _canonical(value: Any) -> Any:
    """A JSON-able, deterministic stand-in for an export kwarg value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(repr(v) for v in value)
    if type(value).__module__.startswith("torch") and hasattr(value, "shape"):
        from pytest_exportcheck.goldens import tensor_digest

        return {"tensor": tensor_digest(value)}
    return f"{type(value).__module__}.{type(value).__qualname__}:{value!r}"


class ArtifactCache:
    """Exports a toy model with a target once per key; ``root=None`` keeps it in session only.

    Args:
        session_dir: scratch directory of this run (always used for in-session entries
            when there is no ``root``).
        root: the cross-run cache directory (``.pytest_cache/d/exportcheck/artifacts``),
            or ``None`` for ``--export-no-cache``.
        build_model: ``(name, seed) -> nn.Module``.
    """

    def __init__(
        self,
        session_dir: Path,
        root: Path | None,
        build_model: Callable[[str, int], Any],
        registries: Registries,
    ) -> None:
        self.session_dir = session_dir
        self.root = root
        self.build_model = build_model
        #: where a target's factory and record are looked up, and what exports
        self.registries = registries
        self._memo: dict[str, Path | BaseException] = {}
        self._fingerprints: dict[tuple[str, int], str] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        #: Entries refused (tampered, truncated, foreign) and rebuilt in this session.
        self.evicted = 0
        if root is not None and root.is_dir():
            for stale in sweep_dead_writers(root, _KEY_LENGTH):
                logger.info("removed %s, left in the artifact cache by a dead writer", stale)

    def key(
        self,
        target: str,
        factory: Callable[..., Any],
        kwargs: Mapping[str, Any],
        model: Any,
        seed: int,
        device: str,
    ) -> str:
        """The cache key of one export (hex sha256); ``model``: a family name or a model."""
        material = {
            "format": CACHE_FORMAT,
            "target": target,
            "kwargs": _canonical(dict(kwargs)),
            "model": model if isinstance(model, str) else _class_name(type(model)),
            "seed": seed if isinstance(model, str) else None,
            "device": device,
            "model_fingerprint": (
                self._fingerprint(model, seed) if isinstance(model, str) else _fingerprint_of(model)
            ),
            "source": source_digest(getattr(factory, "__module__", None) or "?"),
            "versions": factory_versions(factory),
        }
        text = json.dumps(material, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:_KEY_LENGTH]

    def _fingerprint(self, model: str, seed: int) -> str:
        if (model, seed) not in self._fingerprints:
            self._fingerprints[(model, seed)] = _fingerprint_of(self.build_model(model, seed))
        return self._fingerprints[(model, seed)]

    def export(
        self,
        target: str,
        kwargs: Mapping[str, Any],
        model: Any,
        *,
        seed: int = 0,
        device: str = "cpu",
        suffix: str = "",
        directory: bool = False,
        key: str | None = None,
    ) -> Path:
        """The artifact of ``model`` exported with ``target`` and ``kwargs``.

        ``model`` is a toy family name (built with ``seed`` on ``device``) or a
        model instance (exported as it is; ``seed`` is ignored). The returned path
        is shared between checks and runs and read-only.

        A failed export is remembered for the session and raised again, so a broken
        target costs one export attempt per key, not one per check. ``key``: this
        export's :meth:`key`, when the caller computed it already (it fingerprints the
        model's weights: once per export, not twice).
        """
        if key is None:
            factory = self.registries.target_factory(target)
            key = self.key(target, factory, kwargs, model, seed, device)
        with self._lock:
            known = self._memo.get(key)
        if isinstance(known, BaseException):
            raise known
        if known is not None:
            self.hits += 1
            return known
        try:
            path = self._load_or_export(
                key, target, kwargs, (model, seed, device), suffix, directory
            )
        except Exception as err:
            with self._lock:
                self._memo[key] = err
            raise
        with self._lock:
            self._memo[key] = path
        return path

    def _load_or_export(
        self,
        key: str,
        target: str,
        kwargs: Mapping[str, Any],
        model: tuple[Any, int, str],
        suffix: str,
        directory: bool,
    ) -> Path:
        executes_code = _executes_code(self.registries, target)
        label = model[0] if isinstance(model[0], str) else _class_name(type(model[0]))
        with contextlib.ExitStack() as stack:
            root = self._locked_root(stack, key)
            entry = root / key
            hit = self._verified(entry, key, executes_code, f"{target} / {label}")
            if hit is not None:
                self.hits += 1
                return hit
            self.misses += 1
            staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
            try:
                name = "artifact" if directory else f"model{suffix}"
                artifact = self._export(target, kwargs, model, staging / "out" / name)
                fields = {"target": target, "model": [label, *model[1:]]}
                write_meta(staging, artifact, fields, CACHE_FORMAT, key=key)
                _make_read_only(staging / "out")
                with contextlib.suppress(OSError):  # another worker published it first
                    os.replace(staging, entry)
            finally:
                if staging.exists():
                    _remove(staging)
            try:
                published = read_entry(entry, CACHE_FORMAT, executes_code=executes_code, key=key)
            except UnsoundEntryError as err:  # e.g. no signing key: use it this session only
                logger.debug("entry %s does not verify after publishing: %s", entry, err)
                published = entry / "out" / name if (entry / "out" / name).exists() else None
            if published is None:  # pragma: no cover - only if the published entry vanished
                raise RuntimeError(f"artifact cache entry {entry} disappeared after publishing")
            return published

    def _locked_root(self, stack: contextlib.ExitStack, key: str) -> Path:
        """The directory of ``key``'s entry, its lock held; the session's when the lock is unsafe."""
        if self.root is not None:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                stack.enter_context(exclusive_lock(self.root / f"{key}.lock"))
                return self.root
            except UnsafeLockFileError as err:
                warnings.warn(
                    ExportCheckWarning(
                        f"artifact cache: {err} This export runs outside the cross-run cache "
                        "(in this session's directory); it is not a failure of the target."
                    ),
                    stacklevel=4,
                )
        self.session_dir.mkdir(parents=True, exist_ok=True)
        stack.enter_context(exclusive_lock(self.session_dir / f"{key}.lock"))
        return self.session_dir

    def _verified(self, entry: Path, key: str, executes_code: bool, what: str) -> Path | None:
        """The entry's artifact when it verifies for ``key``; a refused one is evicted with a warning."""
        try:
            return read_entry(entry, CACHE_FORMAT, executes_code=executes_code, key=key)
        except UnsoundEntryError as err:
            self.evicted += 1
            warnings.warn(
                ExportCheckWarning(
                    f"artifact cache entry {entry} ({what}) was not used and is rebuilt: {err}. "
                    "Nothing was loaded from it; this is not a failure of the target."
                ),
                stacklevel=2,
            )
            evict(entry)
            return None

    def _export(
        self, target: str, kwargs: Mapping[str, Any], model: tuple[Any, int, str], out: Path
    ) -> Path:
        name, seed, device = model
        out.parent.mkdir(parents=True, exist_ok=True)
        label = name if isinstance(name, str) else _class_name(type(name))
        logger.info("exporting %s with %s%s", label, target, f" {dict(kwargs)}" if kwargs else "")
        built = self.build_model(name, seed).to(device) if isinstance(name, str) else name
        returned = Path(self.registries.export(target, built, out, **kwargs))
        path = returned.resolve()
        if not path.exists():
            raise ArtifactPathError(
                f"exporting {label!r} with target {target!r} returned {returned}, which does not "
                "exist; return the path of the artifact the export wrote"
            )
        if path.parent != out.parent.resolve():
            raise ArtifactPathError(
                f"exporting {label!r} with target {target!r} to {out} returned {returned}, not a "
                f"path in the output directory {out.parent}; write the artifact there"
            )
        return path


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _fingerprint_of(model: Any) -> str:
    """:func:`model_fingerprint` plus the :func:`code_digest` of the model's class."""
    return f"{model_fingerprint(model)}:{code_digest(type(model))}"


def _executes_code(registries: Registries, target: str) -> bool:
    """Whether loading ``target``'s artifacts can execute code (its ``TargetInfo``)."""
    return bool(getattr(registries.target_info(target), "executes_code", False))


def _make_read_only(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _remove(path: Path) -> None:
    # Read-only files in a writable directory are removable on POSIX.
    shutil.rmtree(path, ignore_errors=True)
