"""Export targets: their declarations, the two registries, and the public entry points.

A target is an export factory ``(model, output_path, **options) -> Path`` with a
:class:`TargetInfo` attached by the :func:`export_target` decorator; its runtime
is a loader ``(artifact, **options) -> (input_ids -> logits)``. Both live in a
:class:`~exportlm.registry.Registry`: :data:`EXPORT_REGISTRY` and
:data:`RUNTIME_REGISTRY`, filled by :func:`ensure_exporters_registered` with the
built-in ``onnx`` target (in code) and every entry point of the
``exportlm.export_backends`` / ``exportlm.export_runtimes`` groups.
:func:`export_model` and :func:`load_exported` are what users call.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from exportlm.atomic import check_output_path
from exportlm.errors import InvalidModelError

# guard imports TargetInfo only for typing, so importing it here is not circular.
from exportlm.export.guard import (
    finish_manifest,
    manifest_for_export,
    verified_load,
)
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
    "runtime_loader",
]

EXPORT_BACKENDS_GROUP = "exportlm.export_backends"
EXPORT_RUNTIMES_GROUP = "exportlm.export_runtimes"

#: Capability names a target may declare. The conformance suite reads them.
CAPABILITIES = frozenset({"dynamic_shapes", "kv_cache", "quantized", "multi_file", "cuda"})

F = TypeVar("F", bound=Callable[..., Any])


class RuntimeCallable(Protocol):
    """A loaded artifact: ``input_ids (LongTensor [batch, seq]) -> logits (FloatTensor)``."""

    def __call__(self, input_ids: Any) -> Any: ...


class ExportFactory(Protocol):
    """``(model, output_path, **kwargs) -> Path`` of the written artifact."""

    def __call__(self, model: Any, output_path: Path, **kwargs: Any) -> Path: ...


class RuntimeLoader(Protocol):
    """``(artifact, **kwargs) -> RuntimeCallable``."""

    def __call__(self, artifact: Path, **kwargs: Any) -> RuntimeCallable: ...


@dataclass(frozen=True)
class TargetInfo:
    """What an export target declares about itself, in one place the harness reads.

    Attributes:
        name: the target's registry name.
        runtime: name of the runtime loader in :data:`RUNTIME_REGISTRY` that runs the artifact.
        atol, rtol: logits tolerance of a roundtrip against the eager model
            (``|a - b| <= atol + rtol * |b|`` elementwise).
        capabilities: subset of :data:`CAPABILITIES`.
        artifact: ``"file"`` or ``"directory"``.
        suffix: conventional file suffix (``".onnx"``), informative.
        variants: named kwarg sets the conformance suite exports with, e.g.
            ``{"trace": {"method": "trace"}, "script": {"method": "script"}}``;
            empty means one default variant.
        expected_failures: ``{pattern: reason}``. A pattern is a check id
            (``"roundtrip_logits"``) or an fnmatch pattern over the full item id
            ``check[target-model-device]`` (``"roundtrip_logits[torchscript:script-*]"``).
        accepts: optional ``model -> reason | None``; a reason means the target
            cannot take that model (a counted skip in the suite, an error in export).
        description: one line for ``exportlm list``.
        executes_code: loading the artifact can execute code (unpickling, TorchScript):
            :func:`load_exported` then refuses an artifact whose manifest does not prove
            it was written on this machine unless ``trust=True`` (see ``docs/security.md``).
    """

    name: str
    runtime: str
    atol: float = 1e-4
    rtol: float = 1e-3
    capabilities: frozenset[str] = frozenset()
    artifact: Literal["file", "directory"] = "file"
    suffix: str = ""
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    expected_failures: Mapping[str, str] = field(default_factory=dict)
    accepts: Callable[[Any], str | None] | None = field(default=None, compare=False)
    description: str = ""
    executes_code: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.capabilities) - CAPABILITIES
        if unknown:
            raise ValueError(
                f"target {self.name!r} declares unknown capabilities {sorted(unknown)}; "
                f"known: {sorted(CAPABILITIES)}"
            )
        if self.artifact not in ("file", "directory"):
            raise ValueError(f"target {self.name!r}: artifact must be 'file' or 'directory'")
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))

    def has(self, capability: str) -> bool:
        """True when the target declares ``capability``."""
        return capability in self.capabilities


_INFO_ATTR = "__exportlm_target__"


def export_target(
    name: str,
    *,
    runtime: str | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-3,
    capabilities: frozenset[str] | set[str] | tuple[str, ...] = (),
    artifact: Literal["file", "directory"] = "file",
    suffix: str = "",
    variants: Mapping[str, Mapping[str, Any]] | None = None,
    expected_failures: Mapping[str, str] | None = None,
    accepts: Callable[[Any], str | None] | None = None,
    description: str = "",
    executes_code: bool = False,
) -> Callable[[F], F]:
    """Decorator declaring an export factory's :class:`TargetInfo`.

    ``runtime`` defaults to ``name``. ``executes_code=True`` declares that loading
    the artifact can run code (a pickle, TorchScript): see :class:`TargetInfo`. The decorated function is unchanged apart
    from the attached declaration, so it can be registered in code or exposed
    through the ``exportlm.export_backends`` entry-point group.
    """
    info = TargetInfo(
        name=name,
        runtime=runtime or name,
        atol=atol,
        rtol=rtol,
        capabilities=frozenset(capabilities),
        artifact=artifact,
        suffix=suffix,
        variants=dict(variants or {}),
        expected_failures=dict(expected_failures or {}),
        accepts=accepts,
        description=description,
        executes_code=executes_code,
    )

    def decorate(fn: F) -> F:
        setattr(fn, _INFO_ATTR, info)
        return fn

    return decorate


def get_target_info(name_or_factory: str | Callable[..., Any]) -> TargetInfo:
    """The :class:`TargetInfo` of a registered target name or of a factory."""
    if isinstance(name_or_factory, str):
        ensure_exporters_registered()
        factory = EXPORT_REGISTRY.get(name_or_factory)
        declared = getattr(factory, _INFO_ATTR, None)
        if not isinstance(declared, TargetInfo):
            # Registered without a declaration: defaults, runtime named after the target.
            return TargetInfo(name=name_or_factory, runtime=name_or_factory)
        if declared.name == name_or_factory:
            return declared
        return replace(declared, name=name_or_factory)
    info = getattr(name_or_factory, _INFO_ATTR, None)
    if not isinstance(info, TargetInfo):
        raise TypeError(f"{name_or_factory!r} has no target declaration; use @export_target")
    return info


def _validate_factory(name: str, obj: Any) -> Callable[..., Any]:
    """Accept an export factory, or a zero-argument builder returning one."""
    if not callable(obj):
        raise TypeError(f"export target {name!r} must be callable, got {type(obj).__name__}")
    if getattr(obj, _INFO_ATTR, None) is None and _required_positional(obj) == 0:
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
    """Register the built-in ``onnx`` target and load entry-point targets and runtimes.

    Idempotent and thread-safe. Plugins that fail to load are recorded
    (``EXPORT_REGISTRY.failed()``), warned about, and raise on lookup of their
    name; they never hide the other targets. ``onnx`` resolves even with
    ``EXPORTLM_DISABLE_PLUGINS=1`` or no entry-point metadata at all.
    """
    # Registered by import, not by entry point: ``onnx`` must resolve with no
    # entry-point metadata. The module imports no ONNX package; without the
    # ``onnx`` extra the target is listed and raises MissingDependencyError on use.
    from exportlm.export.onnx import build_onnx_exporter, load_onnx

    EXPORT_REGISTRY.register("onnx", build_onnx_exporter(), builtin=True)
    RUNTIME_REGISTRY.register("onnx", load_onnx, builtin=True)
    load_entry_point_registry(EXPORT_BACKENDS_GROUP, EXPORT_REGISTRY, raise_errors=False)
    load_entry_point_registry(EXPORT_RUNTIMES_GROUP, RUNTIME_REGISTRY, raise_errors=False)


def export_model(name: str, model: Any, output_path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Export ``model`` with the target ``name`` to ``output_path``; returns the artifact path.

    Args:
        name: a registered export target (``exportlm list``), e.g. ``"onnx"``.
        model: any ``nn.Module`` whose ``forward(input_ids)`` returns logits,
            ``(logits, cache)`` or an object with ``.logits``.
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
    info = get_target_info(name)
    if info.accepts is not None:
        reason = info.accepts(model)
        if reason:
            raise InvalidModelError(f"export target {name!r} cannot export this model: {reason}")
    check_output_path(output_path)
    with manifest_for_export(info, model, output_path, kwargs) as request:
        result = Path(factory(model, Path(output_path), **kwargs))
    finish_manifest(request, result)
    return result


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
    loader = runtime_loader(name)
    check_kwargs(f"runtime of target {name!r}", loader, kwargs, skip=1)
    with verified_load(get_target_info(name), Path(path), trust=trust) as manifest:
        runtime = loader(Path(path), **kwargs)
    if manifest is not None and manifest.vocab_size and hasattr(runtime, "vocab_size"):
        runtime.vocab_size = manifest.vocab_size  # runtimes refuse ids outside it
    return runtime  # type: ignore[no-any-return]
