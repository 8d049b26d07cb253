"""Export targets: the two registries, and the public entry points.

A target is an export factory ``(model, output_path, **options) -> Path`` declared
with :func:`~exportlm.export.declaration.export_target`; its runtime is a loader
``(artifact, **options) -> (input_ids -> logits)``. Both live in a
:class:`~exportlm.registry.Registry`: :data:`EXPORT_REGISTRY` and
:data:`RUNTIME_REGISTRY`, filled by :func:`ensure_exporters_registered` with the four
built-ins (in code, :mod:`~exportlm.export.builtins`) and every entry point of the
``exportlm.export_backends`` / ``exportlm.export_runtimes`` groups.
:func:`export_model` and :func:`load_exported` are what users call.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exportlm.export.builtins import register_builtin_targets
from exportlm.export.declaration import (
    CAPABILITIES,
    ExportFactory,
    RuntimeCallable,
    RuntimeLoader,
    TargetInfo,
    declared_info,
    export_target,
)
from exportlm.export.guard import verified_load
from exportlm.export.job import run_export
from exportlm.export.options import check_kwargs
from exportlm.registry import Registry, load_entry_point_registry, once

__all__ = [
    "CAPABILITIES",
    "EXPORT_BACKENDS_GROUP",
    "EXPORT_REGISTRY",
    "EXPORT_RUNTIMES_GROUP",
    "RUNTIME_REGISTRY",
    "ExportFactory",
    "RuntimeCallable",
    "RuntimeLoader",
    "TargetInfo",
    "ensure_exporters_registered",
    "export_model",
    "export_target",
    "get_target_info",
    "load_exported",
    "load_with",
    "registered_info",
    "runtime_loader",
]

EXPORT_BACKENDS_GROUP = "exportlm.export_backends"
EXPORT_RUNTIMES_GROUP = "exportlm.export_runtimes"


def get_target_info(name_or_factory: str | Callable[..., Any]) -> TargetInfo:
    """The :class:`TargetInfo` of a registered target name or of a factory."""
    if isinstance(name_or_factory, str):
        ensure_exporters_registered()
        return _registered_info(name_or_factory, EXPORT_REGISTRY.get(name_or_factory))
    info = declared_info(name_or_factory)
    if info is None:
        raise TypeError(f"{name_or_factory!r} has no target declaration; use @export_target")
    return info


def registered_info(name: str, factory: Callable[..., Any]) -> TargetInfo:
    """The declaration of ``factory`` as registered under ``name`` (in any registry)."""
    # Registered without a declaration: defaults, runtime named after the target.
    return declared_info(factory, name) or TargetInfo(name=name, runtime=name)


_registered_info = registered_info


def _validate_factory(name: str, obj: Any) -> Callable[..., Any]:
    """Accept an export factory, or a zero-argument builder returning one."""
    if not callable(obj):
        raise TypeError(f"export target {name!r} must be callable, got {type(obj).__name__}")
    if declared_info(obj) is None and _required_positional(obj) == 0:
        built = obj()
        if not callable(built):
            raise TypeError(
                f"export target builder {name!r} returned {type(built).__name__}, "
                "expected an export factory (model, output_path, **kwargs) -> Path"
            )
        obj = built
    if _required_positional(obj) > 2:
        raise TypeError(
            f"export target {name!r} must have the signature (model, output_path, **kwargs); "
            f"got {inspect.signature(obj)}"
        )
    return obj  # type: ignore[no-any-return]


def _validate_runtime(name: str, obj: Any) -> Callable[..., Any]:
    if not callable(obj):
        raise TypeError(f"runtime {name!r} must be callable, got {type(obj).__name__}")
    return obj  # type: ignore[no-any-return]


def _required_positional(fn: Callable[..., Any]) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 1
    return sum(
        1
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    )


#: Export targets: name -> export factory ``(model, output_path, **kwargs) -> Path``.
EXPORT_REGISTRY: Registry[Callable[..., Any]] = Registry("export target", _validate_factory)
#: Runtimes: name -> loader ``(artifact, **kwargs) -> (input_ids -> logits)``.
RUNTIME_REGISTRY: Registry[Callable[..., Any]] = Registry("runtime", _validate_runtime)


@once
def ensure_exporters_registered() -> None:
    """Register the four built-in targets and load entry-point targets and runtimes.

    Idempotent and thread-safe. Plugins that fail to load are recorded
    (``EXPORT_REGISTRY.failed()``), warned about, and raise on lookup of their
    name; they never hide the other targets. The built-ins are registered in code,
    so they resolve even with ``EXPORTLM_DISABLE_PLUGINS=1`` or no entry-point
    metadata at all. Without the ``onnx`` extra, ``onnx`` is listed and raises
    MissingDependencyError on use.
    """
    register_builtin_targets(EXPORT_REGISTRY, RUNTIME_REGISTRY)
    load_entry_point_registry(EXPORT_BACKENDS_GROUP, EXPORT_REGISTRY, raise_errors=False)
    load_entry_point_registry(EXPORT_RUNTIMES_GROUP, RUNTIME_REGISTRY, raise_errors=False)


def export_model(name: str, model: Any, output_path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Export ``model`` with the target ``name`` to ``output_path``; returns the artifact path.

    Args:
        name: a registered export target (``exportlm list``), e.g. ``"onnx"``.
        model: any ``nn.Module`` whose ``forward(input_ids)`` returns logits,
            ``(logits, cache)`` or an object with ``.logits``; for ``hf_checkpoint``, also
            a local model directory, streamed layer by layer when it does not fit memory
            (its ``stream`` / ``max_memory`` / ``recipe`` options, ``docs/streaming.md``).
        output_path: file (or directory, for directory targets) to write. The
            write is atomic: a failed export leaves no partial artifact and an
            existing artifact untouched.
        **kwargs: target options; ``example_inputs`` (an ``input_ids`` tensor or a
            tuple of positional inputs) is accepted by every built-in target.

    Raises:
        UnknownNameError: ``name`` is not registered.
        UnknownOptionError: a kwarg the target does not accept (a ``TypeError``).
        InvalidModelError / InvalidInputError: the model or inputs do not fit.
        ExportFailedError: the underlying exporter failed.
        MissingDependencyError: the target needs an optional package that is not
            installed (an ``ImportError``; the message names the pip extra).
    """
    ensure_exporters_registered()
    factory = EXPORT_REGISTRY.get(name)
    check_kwargs(f"export target {name!r}", factory, kwargs)
    return run_export(_registered_info(name, factory), factory, model, Path(output_path), kwargs)


def runtime_loader(name: str) -> Callable[..., Any]:
    """The runtime loader registered for target ``name`` (via its declared runtime)."""
    ensure_exporters_registered()
    info = get_target_info(name)
    return RUNTIME_REGISTRY.get(info.runtime)


def load_exported(
    name: str, path: str | os.PathLike[str], *, trust: bool = False, **kwargs: Any
) -> RuntimeCallable:
    """Load an artifact of target ``name`` in the target's own runtime.

    Returns a callable ``input_ids (LongTensor [batch, seq]) -> logits (float tensor)``.
    ``kwargs`` go to the runtime loader (e.g. ``device="cuda"``).

    Before the loader reads anything, the artifact is checked against its manifest
    (``<file>.manifest.json``, or ``exportlm-manifest.json`` in a directory): a manifest
    written for another artifact (another file name), a file whose sha256 differs, a
    missing or an extra file is refused, ``trust`` or not. No manifest loads with an
    :class:`~exportlm.export.guard.UnverifiedArtifactWarning`. A target whose format can
    execute code when loaded (``TargetInfo.executes_code``: ``torchscript``,
    ``torch_export``) needs ``trust=True`` unless the manifest vouches for the artifact:
    signed by this user's key on this machine, for this target. A file artifact is
    opened once; the loader reads those verified bytes
    (:func:`~exportlm.export.guard.open_artifact`), never the path again (see
    ``docs/security.md``).

    Raises:
        UntrustedArtifactError: a code-executing format without a manifest signed here,
            and ``trust`` is false.
        ArtifactIntegrityError: the manifest is another artifact's, or the files do not
            match it (the file is named).
        ManifestSchemaError: the manifest is unreadable or of an unknown schema.
        UnknownNameError: ``name`` is not registered.
        UnknownOptionError: a kwarg the runtime does not accept (a ``TypeError``).
        RuntimeUnavailableError: the requested device is not available here.
        MissingDependencyError: the runtime needs an optional package that is not
            installed (e.g. onnxruntime for ``onnx``).
    """
    return load_with(get_target_info(name), runtime_loader(name), path, trust=trust, **kwargs)


def load_with(
    info: TargetInfo,
    loader: Callable[..., Any],
    path: str | os.PathLike[str],
    *,
    trust: bool = False,
    **kwargs: Any,
) -> RuntimeCallable:
    """:func:`load_exported` with the target's record and runtime loader given, not looked up
    (the plugin's checks load through the registries they were handed)."""
    check_kwargs(f"runtime of target {info.name!r}", loader, kwargs, skip=1)
    with verified_load(info, Path(path), trust=trust) as manifest:
        runtime = loader(Path(path), **kwargs)
    if manifest is not None and manifest.vocab_size and hasattr(runtime, "vocab_size"):
        runtime.vocab_size = manifest.vocab_size  # runtimes refuse ids outside it
    return runtime  # type: ignore[no-any-return]
