"""What an export target declares about itself: :class:`TargetInfo` and the :func:`export_target` decorator.

The floor of the export core: the job, the trust boundary, every target and the
registries import it; it imports nothing of exportlm. A target is an export factory
``(model, output_path, **options) -> Path`` with a :class:`TargetInfo` attached by
:func:`export_target`; its runtime is a loader ``(artifact, **options) -> (input_ids -> logits)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

__all__ = [
    "CAPABILITIES",
    "CAPTURES",
    "ExportFactory",
    "RuntimeCallable",
    "RuntimeLoader",
    "TargetInfo",
    "declare",
    "declared_info",
    "export_target",
]

#: Capability names a target may declare. The conformance suite reads them.
CAPABILITIES = frozenset({"dynamic_shapes", "kv_cache", "quantized", "multi_file", "cuda"})

#: How a target may capture the model (``TargetInfo.capture``); a toy family declares
#: its known failures per capture (``exportlm.models.FailureCause``), so every target
#: capturing the same way inherits them. ``"weights"``: no graph is captured, the
#: state dict is written and the runtime rebuilds the model (``hf_checkpoint``).
CAPTURES = frozenset(
    {"torch.export", "torchscript-trace", "torchscript-script", "weights", "other"}
)

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
        runtime: name of the runtime loader in ``RUNTIME_REGISTRY`` that runs the artifact.
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
            ``load_exported`` then refuses an artifact whose manifest does not prove
            it was written on this machine unless ``trust=True`` (see ``docs/security.md``).
        capture: how the export captures the model, one of :data:`CAPTURES`
            (``"torch.export"`` for ``torch.export`` and exporters built on it), or
            ``{variant: capture}`` when variants capture differently; ``""``:
            undeclared (the target inherits no family's failure causes).
        unchecked: ``{variant: reason}``, the rows the conformance suite cannot check
            on any toy family (``""`` names the row of a target without variants): the
            row is still run and shown, as *declared unchecked* with the reason, and
            ``--export-strict`` does not fail on it.
        artifact_kind: what the artifact is, in the serving engines' support tables'
            terms: ``"hf_checkpoint"`` (a Hugging Face checkpoint directory),
            ``"onnx"`` (an ONNX graph), or a kind a third-party engine's table names;
            ``""``: nothing an engine serves (no ``served`` item). Engines match on it,
            never on the file suffix.
        scheme: the quantization scheme every artifact it writes carries, as the engine
            tables name it (an ONNX QDQ graph: ``"int8"``, ``"fp8"``); ``None``: float,
            or (a checkpoint) the one its ``config.json`` states. An engine serves it
            only where its table has a row for that scheme, against that scheme's
            tolerance (``docs/engines.md``).
        runtime_library: the distribution its runtime loads artifacts with, as pip names
            it (``"onnxruntime"``); every manifest records it with its installed version
            (``versions["runtime:<library>"]``). ``""``: none beyond those every artifact
            records (exportlm, torch, transformers).
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
    capture: str | Mapping[str, str] = ""
    unchecked: Mapping[str, str] = field(default_factory=dict)
    artifact_kind: str = ""
    scheme: str | None = None
    runtime_library: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.capabilities) - CAPABILITIES
        if unknown:
            raise ValueError(
                f"target {self.name!r} declares unknown capabilities {sorted(unknown)}; "
                f"known: {sorted(CAPABILITIES)}"
            )
        _check_capture(self.name, self.capture, self.variants)
        _check_unchecked(self.name, self.unchecked, self.variants)
        if self.artifact not in ("file", "directory"):
            raise ValueError(f"target {self.name!r}: artifact must be 'file' or 'directory'")
        if self.scheme is not None and not self.artifact_kind:
            raise ValueError(
                f"target {self.name!r} declares scheme={self.scheme!r} but no artifact_kind; "
                "say what the artifact is (artifact_kind='onnx', 'hf_checkpoint', ...)"
            )
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))

    def has(self, capability: str) -> bool:
        """True when the target declares ``capability``."""
        return capability in self.capabilities

    def capture_of(self, variant: str | None = None) -> str:
        """How the row ``variant`` (``None``: the target itself) captures the model; ``""``: undeclared."""
        if isinstance(self.capture, str):
            return self.capture
        return self.capture.get(variant or "", "")


def _check_capture(
    name: str, capture: str | Mapping[str, str], variants: Mapping[str, Any]
) -> None:
    values = [capture] if isinstance(capture, str) else list(capture.values())
    unknown = sorted(v for v in values if v and v not in CAPTURES)
    if unknown or not isinstance(capture, (str, Mapping)):
        raise ValueError(
            f"target {name!r}: unknown capture {unknown or capture!r}; known: {sorted(CAPTURES)}"
            " (or {variant: capture})"
        )
    if isinstance(capture, Mapping) and set(capture) - set(variants):
        raise ValueError(
            f"target {name!r}: capture names variants it does not declare: "
            f"{sorted(set(capture) - set(variants))}"
        )


def _check_unchecked(name: str, unchecked: Mapping[str, str], variants: Mapping[str, Any]) -> None:
    rows = set(variants) or {""}
    if not isinstance(unchecked, Mapping) or set(unchecked) - rows:
        raise ValueError(
            f"target {name!r}: unchecked names rows it does not have: "
            f"{sorted(set(unchecked) - rows) if isinstance(unchecked, Mapping) else unchecked!r}"
            f"; its rows: {sorted(rows)} ({{variant: reason}}, '' without variants)"
        )
    empty = sorted(k for k, reason in unchecked.items() if not str(reason).strip())
    if empty:
        raise ValueError(f"target {name!r}: unchecked rows {empty} give no reason")


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
    capture: str | Mapping[str, str] = "",
    unchecked: Mapping[str, str] | None = None,
    artifact_kind: str = "",
    scheme: str | None = None,
    runtime_library: str = "",
) -> Callable[[F], F]:
    """Decorator declaring an export factory's :class:`TargetInfo`.

    ``runtime`` defaults to ``name``. ``executes_code=True`` declares that loading
    the artifact can run code (a pickle, TorchScript); ``capture`` says how the model is
    captured (``"torch.export"``, ``"torchscript-trace"``, ...); ``unchecked`` the rows the
    conformance suite cannot check on any toy family; ``artifact_kind`` and ``scheme`` say
    what the artifact is, for the serving engines; ``runtime_library`` the distribution its
    runtime loads with, recorded in every manifest: see :class:`TargetInfo`. The
    decorated function is unchanged apart from the attached declaration, so it can be
    registered in code or exposed through the ``exportlm.export_backends`` entry-point group.
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
        capture=capture if isinstance(capture, str) else dict(capture),
        unchecked=dict(unchecked or {}),
        artifact_kind=artifact_kind,
        scheme=scheme,
        runtime_library=runtime_library,
    )

    def decorate(fn: F) -> F:
        return declare(fn, info)

    return decorate


def declare(factory: F, info: TargetInfo) -> F:
    """Attach ``info`` to ``factory`` (what :func:`export_target` does); returns ``factory``."""
    setattr(factory, _INFO_ATTR, info)
    return factory


def declared_info(factory: Callable[..., Any], name: str | None = None) -> TargetInfo | None:
    """The :class:`TargetInfo` attached to ``factory`` (``None`` when it has none).

    With ``name``, the declaration as registered under that name (a factory
    registered under another name than it declares answers to the registered one).
    """
    info = getattr(factory, _INFO_ATTR, None)
    if not isinstance(info, TargetInfo):
        return None
    if name is None or info.name == name:
        return info
    return replace(info, name=name)
