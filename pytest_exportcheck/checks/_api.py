"""The check contract: results, cases, and the live mapping of checks.

Checks never call pytest; the plugin builds a case, calls the check and turns the
result into pass / fail / skip. The same functions are usable from a script.

Two scopes:
- ``"target"``: parametrized over export targets (and their variants), optionally
  also over toy model families (``per_model=True``) -> called with a :class:`TargetCase`.
- ``"exporter"``: parametrized over module exporters -> called with an :class:`ExporterCase`.

:data:`CHECKS` starts as the built-in catalogue
(:data:`~pytest_exportcheck.checks.catalogue.BUILTIN_CHECKS`, in documentation
order); :func:`register_check` appends more. This module imports neither torch nor
Hypothesis.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pytest_exportcheck.checks._services import CheckServices
from pytest_exportcheck.checks.catalogue import (
    BUILTIN_CHECKS,
    CatalogueError,
    CheckFn,
    CheckSpec,
    Scope,
)

__all__ = [
    "CHECKS",
    "CatalogueError",
    "CheckResult",
    "CheckSpec",
    "ExporterCase",
    "TargetCase",
    "UnknownCheckError",
    "check",
    "get_check",
    "register_check",
]


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check.

    ``status`` is ``"pass"``, ``"fail"`` or ``"skip"`` (a capability gap, with the
    reason in ``message``). ``details`` carries numbers for the report
    (e.g. ``max_abs``, ``max_rel``, ``mismatch_pct``).

    ``exception`` is the exception raised by the code under test (an export
    factory, a runtime loader or its callable, a module exporter) when that is
    what made the check fail, so a debugger (``--pdb``) can land in the author's
    frame. It takes no part in equality or ``repr``.
    """

    status: Literal["pass", "fail", "skip"]
    message: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    @classmethod
    def passed(cls, message: str = "", **details: Any) -> CheckResult:
        """A pass, with an optional note and numbers for the report."""
        return cls("pass", message, details)

    @classmethod
    def failed(
        cls, message: str, *, exception: BaseException | None = None, **details: Any
    ) -> CheckResult:
        """A failure; pass ``exception`` when the code under test raised it."""
        return cls("fail", message, details, exception)

    @classmethod
    def skipped(cls, reason: str, **details: Any) -> CheckResult:
        """A counted skip (a capability gap), with the reason."""
        return cls("skip", reason, details)

    @property
    def ok(self) -> bool:
        """Whether the result is not a failure."""
        return self.status != "fail"


@dataclass
class TargetCase:
    """Everything a target check needs; built by the plugin (or a script).

    Attributes:
        target: registry name of the export target (``"onnx"``).
        variant: variant name or ``None`` (see ``TargetInfo.variants``).
        export_kwargs: kwargs of the variant, passed to ``export_model``.
        model_name: toy model family (``MODEL_REGISTRY`` name) or ``None`` for
            checks that are not per model.
        device: ``"cpu"`` or ``"cuda"``.
        workdir: an empty directory the check may write into.
        export: ``(model_name, **extra_kwargs) -> Path`` exporting that family with
            this target/variant, cached by the plugin; checks should use it instead
            of calling ``export_model`` when the artifact can be shared. The
            artifact is exported into an empty directory of its own (so its
            directory holds exactly what the export wrote) and must not be modified.
        seed: model seed.
        goldens: a golden store (``pytest_exportcheck.goldens``) honouring
            ``--export-goldens-dir`` / ``--export-update-goldens``, or ``None``.
        options: the resolved plugin options (read-only), for checks that need them.
        export_instance: ``(model, **extra_kwargs) -> Path``: like ``export``, for
            a model the check built itself (cached by its class, config, weights
            and source); ``None``: checks export such models afresh.
        services: what the checks of one process share (toy models, runtimes, the
            item's time profile; :class:`~pytest_exportcheck.checks._services.CheckServices`);
            by default a fresh one, so nothing is shared.
        engine: the serving engine of a ``per_engine`` check's item (``served``), else ``None``.
    """

    target: str
    variant: str | None
    export_kwargs: Mapping[str, Any]
    model_name: str | None
    device: str
    workdir: Path
    export: Callable[..., Path] | None = None
    seed: int = 0
    goldens: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)
    export_instance: Callable[..., Path] | None = None
    services: CheckServices = field(default_factory=CheckServices, repr=False, compare=False)
    engine: str | None = None

    @property
    def target_id(self) -> str:
        """``target`` or ``target:variant``: the row label of the matrix."""
        return f"{self.target}:{self.variant}" if self.variant else self.target


@dataclass
class ExporterCase:
    """A module exporter under test, by its name in the module-exporter registry.

    ``model_name`` is set for per-model exporter checks; ``goldens``,
    ``options`` and ``services`` as in :class:`TargetCase`.
    """

    name: str
    workdir: Path
    device: str = "cpu"
    seed: int = 0
    model_name: str | None = None
    goldens: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)
    services: CheckServices = field(default_factory=CheckServices, repr=False, compare=False)


class UnknownCheckError(KeyError):
    """No check is registered under the id that was asked for."""


_CHECKS: dict[str, CheckSpec] = {spec.id: spec for spec in BUILTIN_CHECKS}
if len(_CHECKS) != len(BUILTIN_CHECKS):  # pragma: no cover - a typo in the catalogue
    raise CatalogueError("the built-in catalogue declares a check id twice")

#: id -> :class:`CheckSpec`: the built-in catalogue in documentation order, then the
#: checks added with :func:`register_check`, in registration order. Read-only.
CHECKS: Mapping[str, CheckSpec] = MappingProxyType(_CHECKS)
_BUILTIN_IDS = frozenset(_CHECKS)


def register_check(spec: CheckSpec) -> CheckSpec:
    """Append ``spec`` to :data:`CHECKS` (after the built-in checks); returns it.

    The way to add a check that is not built in: give its implementation as the
    function itself or as a ``"module:function"`` reference. Registering an equal
    spec again (a module imported twice) is a no-op; another check under an id
    that is taken raises :class:`CatalogueError` naming both implementations.
    The plugin plans the checks registered before its collection starts.
    """
    existing = _CHECKS.get(spec.id)
    if existing is not None:
        if existing == spec:
            return existing
        raise CatalogueError(
            f"check id {spec.id!r} is already registered (implementation "
            f"{_describe(existing.impl)}); refusing {_describe(spec.impl)}: choose another id"
        )
    _CHECKS[spec.id] = spec
    return spec


def _describe(impl: str | CheckFn) -> str:
    if isinstance(impl, str):
        return impl
    return f"{getattr(impl, '__module__', '?')}:{getattr(impl, '__qualname__', repr(impl))}"


def check(
    id: str,
    *,
    scope: Scope | None = None,
    per_model: bool = False,
    needs: tuple[str, ...] = (),
    markers: tuple[str, ...] = (),
    value: bool = False,
) -> Callable[[CheckFn], CheckFn]:
    """Mark a function as the implementation of check ``id``; returns it unchanged.

    For a built-in id, the metadata lives in the catalogue only
    (:mod:`pytest_exportcheck.checks.catalogue`): give nothing but the id, and the
    decorator verifies that the catalogue's reference names this function. For
    any other id, give the metadata: the function is registered with
    :func:`register_check` (its docstring's first paragraph is the summary);
    ``value=True`` makes it a value check (:attr:`CheckSpec.value`).
    """
    metadata = scope is not None or per_model or bool(needs) or bool(markers) or value

    def decorate(fn: CheckFn) -> CheckFn:
        reference = f"{fn.__module__}:{fn.__qualname__}"
        if id in _BUILTIN_IDS:
            spec = _CHECKS[id]
            if metadata:
                raise CatalogueError(
                    f"@check({id!r}, ...) on {reference}: {id!r} is a built-in check, whose "
                    "scope, per_model, needs, markers and value are declared in "
                    "pytest_exportcheck/checks/catalogue.py only; write @check({id!r})"
                )
            if spec.impl != reference:
                raise CatalogueError(
                    f"@check({id!r}) decorates {reference}, but the catalogue names "
                    f"{_describe(spec.impl)} as its implementation"
                )
            return fn
        if scope is None:
            raise CatalogueError(
                f"@check({id!r}) on {reference}: {id!r} is not a built-in check; give its "
                "scope ('target' or 'exporter') to register it"
            )
        register_check(
            CheckSpec(
                id,
                scope,
                fn,
                per_model=per_model,
                needs=frozenset(needs),
                markers=frozenset(markers),
                summary=_first_paragraph(fn.__doc__),
                value=value,
            )
        )
        return fn

    return decorate


def _first_paragraph(doc: str | None) -> str:
    text = (doc or "").strip().split("\n\n", 1)[0]
    return " ".join(text.split())


def get_check(id: str) -> CheckSpec:
    """The :class:`CheckSpec` registered under ``id``; :class:`UnknownCheckError` if none."""
    try:
        return _CHECKS[id]
    except KeyError:
        raise UnknownCheckError(
            f"unknown check {id!r}; known: {', '.join(sorted(_CHECKS))}"
        ) from None
