"""The check catalogue contract: plain functions returning a :class:`CheckResult`.

Checks never call pytest; the plugin builds a case, calls the check and turns the
result into pass / fail / skip. The same functions are usable from a script.

Two scopes:
- ``"target"``: parametrized over export targets (and their variants), optionally
  also over toy model families (``per_model=True``) -> called with a :class:`TargetCase`.
- ``"exporter"``: parametrized over module exporters -> called with an :class:`ExporterCase`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CHECKS",
    "CheckResult",
    "CheckSpec",
    "ExporterCase",
    "TargetCase",
    "check",
    "get_check",
]

Scope = Literal["target", "exporter"]


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check.

    ``status`` is ``"pass"``, ``"fail"`` or ``"skip"`` (a capability gap, with the
    reason in ``message``). ``details`` carries numbers for the report
    (e.g. ``max_abs``, ``max_rel``, ``mismatch_pct``).
    """

    status: Literal["pass", "fail", "skip"]
    message: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def passed(cls, message: str = "", **details: Any) -> CheckResult:
        return cls("pass", message, details)

    @classmethod
    def failed(cls, message: str, **details: Any) -> CheckResult:
        return cls("fail", message, details)

    @classmethod
    def skipped(cls, reason: str, **details: Any) -> CheckResult:
        return cls("skip", reason, details)

    @property
    def ok(self) -> bool:
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

    @property
    def target_id(self) -> str:
        """``target`` or ``target:variant``: the row label of the matrix."""
        return f"{self.target}:{self.variant}" if self.variant else self.target


@dataclass
class ExporterCase:
    """A module exporter under test, by its name in the module-exporter registry.

    ``model_name`` is set for per-model exporter checks; ``goldens`` and
    ``options`` as in :class:`TargetCase`.
    """

    name: str
    workdir: Path
    device: str = "cpu"
    seed: int = 0
    model_name: str | None = None
    goldens: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckSpec:
    """A registered check: stable id, scope, needed capabilities and the function."""

    id: str
    scope: Scope
    fn: Callable[[Any], CheckResult]
    per_model: bool = False
    needs: frozenset[str] = frozenset()
    doc: str = ""


#: id -> CheckSpec, in registration (documentation) order.
CHECKS: dict[str, CheckSpec] = {}


def check(
    id: str, *, scope: Scope, per_model: bool = False, needs: tuple[str, ...] = ()
) -> Callable[[Callable[[Any], CheckResult]], Callable[[Any], CheckResult]]:
    """Register a check function under a stable ``id`` (its docstring is its documentation)."""

    def decorate(fn: Callable[[Any], CheckResult]) -> Callable[[Any], CheckResult]:
        if id in CHECKS and CHECKS[id].fn is not fn:
            raise ValueError(f"check id {id!r} is registered twice")
        CHECKS[id] = CheckSpec(
            id, scope, fn, per_model, frozenset(needs), (fn.__doc__ or "").strip()
        )
        return fn

    return decorate


def get_check(id: str) -> CheckSpec:
    """The :class:`CheckSpec` registered under ``id``."""
    try:
        return CHECKS[id]
    except KeyError:
        raise KeyError(f"unknown check {id!r}; known: {', '.join(sorted(CHECKS))}") from None
