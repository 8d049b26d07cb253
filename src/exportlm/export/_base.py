"""Export-target and runtime registries, target declarations and the public entry points."""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from exportlm.errors import InvalidModelError, OutputExistsError, UnknownOptionError
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
    "atomic_output",
    "check_kwargs",
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
) -> Callable[[F], F]:
    """Decorator declaring an export factory's :class:`TargetInfo`.

    ``runtime`` defaults to ``name``. The decorated function is unchanged apart
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
    from exportlm.export.onnx import export_onnx_target, load_onnx

    EXPORT_REGISTRY.register("onnx", export_onnx_target, builtin=True)
    RUNTIME_REGISTRY.register("onnx", load_onnx, builtin=True)
    load_entry_point_registry(EXPORT_BACKENDS_GROUP, EXPORT_REGISTRY, raise_errors=False)
    load_entry_point_registry(EXPORT_RUNTIMES_GROUP, RUNTIME_REGISTRY, raise_errors=False)


def accepted_kwargs(fn: Callable[..., Any], skip: int = 2) -> tuple[list[str], bool]:
    """(keyword names ``fn`` accepts after its first ``skip`` positionals, has ``**kwargs``)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    names: list[str] = []
    var_kw = False
    positional_seen = 0
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind is p.VAR_POSITIONAL:
            continue
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and positional_seen < skip:
            positional_seen += 1
        elif p.kind is not p.POSITIONAL_ONLY:
            names.append(p.name)
    return names, var_kw


def check_kwargs(
    where: str, fn: Callable[..., Any], kwargs: Mapping[str, Any], skip: int = 2
) -> None:
    """Raise :class:`UnknownOptionError` (a ``TypeError``) for kwargs ``fn`` does not accept.

    Functions with ``**kwargs`` are responsible for their own checking.
    """
    names, var_kw = accepted_kwargs(fn, skip)
    if var_kw:
        return
    unknown = [k for k in kwargs if k not in names]
    if unknown:
        raise UnknownOptionError(where, unknown, names)


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
    """
    ensure_exporters_registered()
    factory = EXPORT_REGISTRY.get(name)
    check_kwargs(f"export target {name!r}", factory, kwargs)
    info = get_target_info(name)
    if info.accepts is not None:
        reason = info.accepts(model)
        if reason:
            raise InvalidModelError(f"export target {name!r} cannot export this model: {reason}")
    result = factory(model, Path(output_path), **kwargs)
    return Path(result)


def runtime_loader(name: str) -> Callable[..., Any]:
    """The runtime loader registered for target ``name`` (via its declared runtime)."""
    ensure_exporters_registered()
    info = get_target_info(name)
    return RUNTIME_REGISTRY.get(info.runtime)


def load_exported(name: str, path: str | os.PathLike[str], **kwargs: Any) -> RuntimeCallable:
    """Load an artifact of target ``name`` in the target's own runtime.

    Returns a callable ``input_ids (LongTensor [batch, seq]) -> logits (float tensor)``.
    ``kwargs`` go to the runtime loader (e.g. ``device="cuda"``).
    """
    loader = runtime_loader(name)
    check_kwargs(f"runtime of target {name!r}", loader, kwargs, skip=1)
    return loader(Path(path), **kwargs)  # type: ignore[no-any-return]


@contextlib.contextmanager
def atomic_output(
    path: str | os.PathLike[str], *, directory: bool = False, overwrite: bool = True
) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; move it into place only on success.

    On any exception the temporary is removed and an existing ``path`` is left
    untouched. For ``directory=True`` the yielded path is an empty directory and
    an existing non-empty directory is replaced only when ``overwrite`` is true
    (otherwise :class:`OutputExistsError`).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not overwrite and target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise OutputExistsError(
            f"{target} exists and is not empty; pass overwrite=True to replace it atomically"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    staged = tmp if directory else tmp / target.name
    try:
        yield staged
        if directory:
            _replace_dir(tmp, target)
        else:
            if not staged.exists():
                raise FileNotFoundError(f"exporter wrote nothing at {staged}")
            # Files written beside the artifact (e.g. ONNX external data) move first,
            # the artifact last, so a reader never sees an artifact without its data.
            for extra in sorted(tmp.iterdir()):
                if extra != staged:
                    os.replace(extra, target.parent / extra.name)
            os.replace(staged, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace_dir(new: Path, target: Path) -> None:
    if target.is_dir() and not target.is_symlink():
        old = target.with_name(f".{target.name}.old-{os.getpid()}-{threading.get_ident()}")
        os.replace(target, old)
        try:
            os.replace(new, target)
        except BaseException:
            os.replace(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        if target.exists():
            target.unlink()
        os.replace(new, target)
