"""Planning and pytest nodes of the conformance suite.

:func:`plan` is a pure function from what is installed and selected to a sorted
list of :class:`ItemSpec` (string ids only, no reprs), so every xdist worker
plans the same items in the same order. The nodes are one
:class:`ExportCheckCollector` (``exportcheck``) under the session, holding one
:class:`ExportCheckItem` per spec: ``exportcheck::roundtrip_logits[onnx-llama-cpu]``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_exportcheck._report import PROPERTY
from pytest_exportcheck.checks._api import CheckResult, CheckSpec

__all__ = [
    "COLLECTOR_NAME",
    "PLUGIN_LOADS",
    "CheckFailed",
    "ExportCheckCollector",
    "ExportCheckItem",
    "ExporterPlan",
    "ItemSpec",
    "Plan",
    "TargetPlan",
    "plan",
]

COLLECTOR_NAME = "exportcheck"
#: The id of the built-in per-plugin item: a broken entry point fails it.
PLUGIN_LOADS = "plugin_loads"


@dataclass(frozen=True)
class ItemSpec:
    """One conformance item, as plain data.

    Attributes:
        check: check id (``roundtrip_logits``) or ``plugin_loads``.
        scope: ``"target"`` or ``"exporter"`` (the matrix it is counted in).
        column: its matrix column: target id (``torchscript:script``) or exporter name.
        params: the id parameters, joined with ``-`` inside the brackets.
        target, variant, export_kwargs: the target row (target scope).
        exporter: the module exporter name (exporter scope).
        model, device: toy model family and device, where the item has them.
        skip: a collection-time skip reason (capability gap), or ``None``.
        failure: for ``plugin_loads``: the load error text, or ``None`` when it loaded.
        check_index: position of the check in the catalogue (matrix row order).
    """

    check: str
    scope: str
    column: str
    params: tuple[str, ...]
    target: str | None = None
    variant: str | None = None
    export_kwargs: Mapping[str, Any] = field(default_factory=dict, compare=False)
    exporter: str | None = None
    model: str | None = None
    device: str | None = None
    skip: str | None = None
    failure: str | None = None
    check_index: int = 0

    @property
    def name(self) -> str:
        """The item id: ``check[param-param-...]``."""
        return f"{self.check}[{'-'.join(self.params)}]"

    def properties(self) -> dict[str, Any]:
        """The coordinates attached to the item's reports (JSON-compatible)."""
        return {
            "id": self.name,
            "check": self.check,
            "scope": self.scope,
            "column": self.column,
            "model": self.model,
            "device": self.device,
            "check_index": self.check_index,
        }


@dataclass(frozen=True)
class TargetPlan:
    """One selected target.

    ``rows`` are its ``(variant, export_kwargs)`` pairs; ``failure`` the text its
    ``plugin_loads`` item fails with (``None``: passes); ``loaded`` false when the
    target itself is missing, so it gets no other item.
    """

    name: str
    rows: tuple[tuple[str | None, Mapping[str, Any]], ...] = ()
    capabilities: frozenset[str] = frozenset()
    failure: str | None = None
    loaded: bool = True


@dataclass(frozen=True)
class ExporterPlan:
    """One selected module exporter; ``failure`` and ``loaded`` as in :class:`TargetPlan`."""

    name: str
    failure: str | None = None
    loaded: bool = True


@dataclass(frozen=True)
class Plan:
    """Inputs of :func:`plan`: selected names, resolved against what is installed.

    ``extra_failures`` are failing ``plugin_loads`` items of plugins that are no
    target or exporter row (``model:<name>``, ``runtime:<name>``).
    """

    checks: tuple[CheckSpec, ...]
    targets: tuple[TargetPlan, ...] = ()
    exporters: tuple[ExporterPlan, ...] = ()
    extra_failures: Mapping[str, str] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu",)


def plan(p: Plan) -> list[ItemSpec]:
    """Every item of the run, in a deterministic order (target rows, then exporters)."""
    index = {spec.id: i for i, spec in enumerate(p.checks)}
    target_checks = [s for s in p.checks if s.scope == "target" and s.id != PLUGIN_LOADS]
    exporter_checks = [s for s in p.checks if s.scope == "exporter" and s.id != PLUGIN_LOADS]
    items: list[ItemSpec] = []
    for target in sorted(p.targets, key=lambda t: t.name):
        if not target.loaded:
            items.append(
                ItemSpec(
                    PLUGIN_LOADS,
                    "target",
                    target.name,
                    (target.name,),
                    target=target.name,
                    failure=target.failure,
                    check_index=-1,
                )
            )
            continue
        for variant, kwargs in target.rows:
            column = f"{target.name}:{variant}" if variant else target.name
            items.append(
                ItemSpec(
                    PLUGIN_LOADS,
                    "target",
                    column,
                    (column,),
                    target=target.name,
                    variant=variant,
                    export_kwargs=kwargs,
                    failure=target.failure,
                    check_index=-1,
                )
            )
            items += _target_items(target, variant, kwargs, target_checks, p, index)
    for param, failure in sorted(p.extra_failures.items()):
        items.append(
            ItemSpec(PLUGIN_LOADS, "target", param, (param,), failure=failure, check_index=-1)
        )
    for exporter in sorted(p.exporters, key=lambda e: e.name):
        name = exporter.name
        if exporter.failure is not None:
            items.append(
                ItemSpec(
                    PLUGIN_LOADS,
                    "exporter",
                    name,
                    (name,),
                    exporter=name,
                    failure=exporter.failure,
                    check_index=-1,
                )
            )
        if not exporter.loaded:
            continue
        for spec in exporter_checks:
            for model in p.models if spec.per_model else (None,):
                params = (name,) if model is None else (name, model)
                items.append(
                    ItemSpec(
                        spec.id,
                        "exporter",
                        name,
                        params,
                        exporter=name,
                        model=model,
                        device="cpu",
                        check_index=index[spec.id],
                    )
                )
    return items


def _target_items(
    target: TargetPlan,
    variant: str | None,
    kwargs: Mapping[str, Any],
    checks: Iterable[CheckSpec],
    p: Plan,
    index: Mapping[str, int],
) -> list[ItemSpec]:
    """The row's items: checks without a model, then per (model, device) every per-model check.

    Adjacent items of one model share its artifact and loaded runtime; xdist's
    ``--dist load`` hands out runs of consecutive items, so they mostly land on
    one worker, which then loads the artifact once.
    """
    column = f"{target.name}:{variant}" if variant else target.name
    checks = list(checks)
    combos: list[tuple[CheckSpec, str | None, str]] = [
        (spec, None, device) for spec in checks if not spec.per_model for device in p.devices
    ]
    combos += [
        (spec, model, device)
        for model in p.models
        for device in p.devices
        for spec in checks
        if spec.per_model
    ]
    items: list[ItemSpec] = []
    for spec, model, device in combos:
        params = (column, device) if model is None else (column, model, device)
        items.append(
            ItemSpec(
                spec.id,
                "target",
                column,
                params,
                target=target.name,
                variant=variant,
                export_kwargs=kwargs,
                model=model,
                device=device,
                skip=_capability_gap(target, spec, device),
                check_index=index[spec.id],
            )
        )
    return items


def _capability_gap(target: TargetPlan, spec: CheckSpec, device: str) -> str | None:
    needed = set(spec.needs) | ({"cuda"} if device == "cuda" else set())
    missing = sorted(needed - target.capabilities)
    if not missing:
        return None
    declared = ", ".join(sorted(target.capabilities)) or "none"
    return (
        f"capability gap: target {target.name!r} does not declare "
        f"{', '.join(map(repr, missing))} (declared: {declared})"
    )


class CheckFailed(Exception):
    """A check returned a failing :class:`CheckResult`; its text is the item's failure."""

    def __init__(self, result: CheckResult) -> None:
        super().__init__(result.message)
        self.result = result

    def __str__(self) -> str:
        lines = [self.result.message or "check failed"]
        for key, value in self.result.details.items():
            lines.append(f"  {key}: {value}")
        return "\n".join(lines)


class ExportCheckCollector(pytest.Collector):
    """The ``exportcheck`` node; its items are added by the plugin after collection."""

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        return []


class ExportCheckItem(pytest.Item):
    """One conformance item; running it hands off to the session's runner."""

    def __init__(
        self,
        *,
        spec: ItemSpec,
        runner: Callable[[ExportCheckItem], None],
        check_fn: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self._runner = runner
        self._check_fn = check_fn
        self.user_properties.append((PROPERTY, spec.properties()))

    def runtest(self) -> None:
        """Run the check (or report the plugin load failure)."""
        self._runner(self)

    def repr_failure(
        self,
        excinfo: pytest.ExceptionInfo[BaseException],
        style: Any = None,
    ) -> Any:
        """A check's own message and details, or pytest's traceback for a crash."""
        if isinstance(excinfo.value, CheckFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path | str, int | None, str]:
        """Where the check function is defined (shown in failure headers)."""
        if self._check_fn is not None:
            try:
                source = inspect.getsourcefile(self._check_fn)
                _, line = inspect.getsourcelines(self._check_fn)
            except (OSError, TypeError):
                source = None
            if source:
                return Path(source), line - 1, self.name
        return self.path, None, self.name
