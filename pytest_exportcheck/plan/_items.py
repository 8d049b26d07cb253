"""The pure planner: what is installed and selected -> the sorted list of items.

:func:`plan` is a pure function from a :class:`Plan` (names resolved against the
registries, check specs, models, devices) to a list of :class:`ItemSpec` with
string ids only (no reprs), so every xdist worker plans the same items in the
same order. It imports nothing but the standard library: the pytest nodes built
from the specs live in :mod:`pytest_exportcheck.session.nodes._nodes`, and the code that fills
a :class:`Plan` from the registries in :mod:`pytest_exportcheck.plan._planner`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_exportcheck.plan._applicability import (
    ENVIRONMENT_CAPABILITIES,
    NotApplicable,
    device_gap,
    model_gap,
    target_gap,
)

if TYPE_CHECKING:
    from pytest_exportcheck.checks import CheckSpec

__all__ = [
    "PLUGIN_LOADS",
    "ExporterPlan",
    "ItemSpec",
    "Plan",
    "TargetPlan",
    "not_applicable",
    "plan",
]

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
        engine: the serving engine of a ``per_engine`` check's item (``served``).
        skip: a collection-time skip reason (capability gap), or ``None``.
        failure: for ``plugin_loads``: the load error text, or ``None`` when it loaded.
        check_index: position of the check in the catalogue (matrix row order).
        markers: names of the pytest markers of the check (besides ``exportcheck``).
        cost: the relative cost of the item, its check's (``CheckSpec.cost``): the
            ``--export-shard`` split balances on it.
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
    engine: str | None = None
    skip: str | None = None
    failure: str | None = None
    check_index: int = 0
    markers: frozenset[str] = frozenset()
    cost: int = 1

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
            "engine": self.engine,
            "check_index": self.check_index,
        }


@dataclass(frozen=True)
class TargetPlan:
    """One selected target.

    ``rows`` are its ``(variant, export_kwargs)`` pairs; ``failure`` the text its
    ``plugin_loads`` item fails with (``None``: passes); ``loaded`` false when the
    target itself is missing, so it gets no other item; ``engines`` the serving
    engines that take what it writes (one item each of a ``per_engine`` check);
    ``artifact`` the kind it writes (``"file"``, ``"directory"``; ``""``: undeclared).
    """

    name: str
    rows: tuple[tuple[str | None, Mapping[str, Any]], ...] = ()
    capabilities: frozenset[str] = frozenset()
    failure: str | None = None
    loaded: bool = True
    engines: tuple[str, ...] = ()
    artifact: str = ""


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
    target or exporter row (``model:<name>``, ``runtime:<name>``). A (row, check)
    pair that cannot apply (:mod:`._applicability`) has no item, unless
    ``keep_inapplicable`` (``run_check``, asked for one item): then its items skip
    with the reason.
    """

    checks: tuple[CheckSpec, ...]
    targets: tuple[TargetPlan, ...] = ()
    exporters: tuple[ExporterPlan, ...] = ()
    extra_failures: Mapping[str, str] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu",)
    keep_inapplicable: bool = False


def plan(p: Plan) -> list[ItemSpec]:
    """Every item of the run, in a deterministic order (target rows, then exporters)."""
    items: list[ItemSpec] = []
    for target in sorted(p.targets, key=lambda t: t.name):
        items += _target_items(target, p)
    for param, failure in sorted(p.extra_failures.items()):
        items.append(_plugin_loads("target", param, failure=failure))
    for exporter in sorted(p.exporters, key=lambda e: e.name):
        items += _exporter_items(exporter, p)
    return items


def _plugin_loads(scope: str, column: str, **where: Any) -> ItemSpec:
    return ItemSpec(PLUGIN_LOADS, scope, column, (column,), check_index=-1, **where)


def _markers(spec: CheckSpec) -> frozenset[str]:
    return frozenset(getattr(spec, "markers", ()))


def _cost(spec: CheckSpec) -> int:
    return int(getattr(spec, "cost", 1))


def _checks(p: Plan, scope: str) -> list[tuple[int, CheckSpec]]:
    """``(catalogue position, spec)`` of the plan's checks of ``scope``, but plugin_loads."""
    return [(i, s) for i, s in enumerate(p.checks) if s.scope == scope and s.id != PLUGIN_LOADS]


def _target_items(target: TargetPlan, p: Plan) -> list[ItemSpec]:
    """``plugin_loads`` of each row, then the row's checks; only the first for a missing target."""
    if not target.loaded:
        return [_plugin_loads("target", target.name, target=target.name, failure=target.failure)]
    items: list[ItemSpec] = []
    for variant, kwargs in target.rows:
        column = f"{target.name}:{variant}" if variant else target.name
        items.append(
            _plugin_loads(
                "target",
                column,
                target=target.name,
                variant=variant,
                export_kwargs=kwargs,
                failure=target.failure,
            )
        )
        items += _row_items(target, variant, kwargs, _checks(p, "target"), p)
    return items


def _row_items(
    target: TargetPlan,
    variant: str | None,
    kwargs: Mapping[str, Any],
    checks: Iterable[tuple[int, CheckSpec]],
    p: Plan,
) -> list[ItemSpec]:
    """The row's items: checks without a model, then per (model, device) every per-model check.

    Adjacent items of one model share its artifact and loaded runtime; xdist's
    ``--dist load`` hands out runs of consecutive items, so they mostly land on
    one worker, which then loads the artifact once. A combination that cannot
    apply (:func:`_inapplicable`) is left out, or skips with the reason when the
    plan keeps those.
    """
    column = f"{target.name}:{variant}" if variant else target.name
    checks = list(checks)
    combos: list[tuple[int, CheckSpec, str | None, str, str | None]] = [
        (i, spec, None, device, None)
        for i, spec in checks
        if not spec.per_model
        for device in p.devices
    ]
    combos += [
        (i, spec, model, device, engine)
        for model in p.models
        for device in p.devices
        for i, spec in checks
        if spec.per_model
        for engine in _engines_of(target, spec)
    ]
    items: list[ItemSpec] = []
    for index, spec, model, device, engine in combos:
        gap = _inapplicable(target, spec, model)
        if gap is not None and not p.keep_inapplicable:
            continue
        items.append(
            ItemSpec(
                spec.id,
                "target",
                column,
                _params(column, engine, model, device),
                target=target.name,
                variant=variant,
                export_kwargs=kwargs,
                model=model,
                device=device,
                engine=engine,
                skip=_NOT_APPLICABLE + gap if gap else _capability_gap(target, spec, device),
                check_index=index,
                markers=_markers(spec),
                cost=_cost(spec),
            )
        )
    return items


def _inapplicable(target: TargetPlan, spec: CheckSpec, model: str | None) -> str | None:
    """Why ``spec`` cannot apply to the row's item of ``model``; ``None`` when it can."""
    engines = len(target.engines) if getattr(spec, "per_engine", False) else 1
    gap = target_gap(spec, target.name, target.capabilities, target.artifact, engines)
    if gap is None and model is not None:
        gap = model_gap(spec, (model,))[1]
    return gap


def _engines_of(target: TargetPlan, spec: CheckSpec) -> tuple[str | None, ...]:
    """A ``per_engine`` check's engines for the target (none: no item), else ``(None,)``."""
    return target.engines if getattr(spec, "per_engine", False) else (None,)


def _params(column: str, engine: str | None, model: str | None, device: str) -> tuple[str, ...]:
    """``column[-engine][-model]-device``: ``served[hf_checkpoint-vllm-llama-cpu]``."""
    return (*(p for p in (column, engine, model) if p is not None), device)


def _exporter_items(exporter: ExporterPlan, p: Plan) -> list[ItemSpec]:
    """A failing ``plugin_loads`` when the exporter failed, then its checks if it loaded."""
    name = exporter.name
    items: list[ItemSpec] = []
    if exporter.failure is not None:
        items.append(_plugin_loads("exporter", name, exporter=name, failure=exporter.failure))
    if not exporter.loaded:
        return items
    for index, spec in _checks(p, "exporter"):
        # Exporter checks run on the CPU; a per_device one also on every other device
        # selected, with the device in its id (the CPU item keeps ``check[exporter]``).
        devices = _exporter_devices(spec, p.devices)
        runs, gap = device_gap(spec, devices)
        for model in p.models if spec.per_model else (None,):
            for device in devices if p.keep_inapplicable else runs:
                params = (name,) if model is None else (name, model)
                items.append(
                    ItemSpec(
                        spec.id,
                        "exporter",
                        name,
                        params if device == "cpu" else (*params, device),
                        exporter=name,
                        model=model,
                        device=device,
                        skip=_NOT_APPLICABLE + gap if gap and device not in runs else None,
                        check_index=index,
                        markers=_markers(spec),
                        cost=_cost(spec),
                    )
                )
    return items


def _exporter_devices(spec: CheckSpec, devices: tuple[str, ...]) -> tuple[str, ...]:
    return devices if getattr(spec, "per_device", False) else ("cpu",)


def not_applicable(p: Plan) -> list[NotApplicable]:
    """The (row, check) pairs :func:`plan` leaves items out of, once each, with the reason."""
    out: list[NotApplicable] = []
    for target in sorted(p.targets, key=lambda t: t.name):
        for variant, _ in target.rows if target.loaded else ():
            column = f"{target.name}:{variant}" if variant else target.name
            for index, spec in _checks(p, "target"):
                out += _target_gaps(target, column, (index, spec), p)
    for exporter in sorted(p.exporters, key=lambda e: e.name):
        for index, spec in _checks(p, "exporter") if exporter.loaded else ():
            devices = _exporter_devices(spec, p.devices)
            runs, gap = device_gap(spec, devices)
            left = (len(devices) - len(runs)) * (len(p.models) if spec.per_model else 1)
            if gap and left:
                out.append(NotApplicable("exporter", exporter.name, spec.id, gap, left, index))
    return out


def _target_gaps(
    target: TargetPlan, column: str, check: tuple[int, CheckSpec], p: Plan
) -> list[NotApplicable]:
    """The pair's record: the whole pair, or the families the check does not run on."""
    index, spec = check
    per_engine = getattr(spec, "per_engine", False)
    engines = len(target.engines) if per_engine else 1
    gap = target_gap(spec, target.name, target.capabilities, target.artifact, engines)
    models: tuple[str | None, ...] = p.models if spec.per_model else (None,)
    if gap is None and spec.per_model:
        kept, gap = model_gap(spec, p.models)
        models = tuple(m for m in p.models if m not in kept)
    if gap is None or not models or not p.devices:
        return []
    # a per-engine check no engine takes never had an item: a cell of 0 items left out
    left = len(models) * len(p.devices) * engines
    return [NotApplicable("target", column, spec.id, gap, left, index)]


def _capability_gap(target: TargetPlan, spec: CheckSpec, device: str) -> str | None:
    """A skip for a capability the target declares by what is installed (``cuda``)."""
    needed = set(spec.needs) & ENVIRONMENT_CAPABILITIES
    needed |= {"cuda"} if device == "cuda" else set()
    missing = sorted(needed - target.capabilities)
    if not missing:
        return None
    declared = ", ".join(sorted(target.capabilities)) or "none"
    hint = _CUDA_HINT if "cuda" in missing else ""
    return (
        f"capability gap: target {target.name!r} does not declare "
        f"{', '.join(map(repr, missing))} (declared: {declared}){hint}"
    )


#: Appended to a missing 'cuda': why a target may run on the CPU only.
_CUDA_HINT = (
    "; its runtime does not run on CUDA in this environment (the built-in onnx target runs "
    "in onnxruntime's CPU provider and declares 'cuda' only when onnxruntime-gpu is installed)"
)
#: Starts the skip reason of a combination that cannot apply, in a plan that keeps those.
_NOT_APPLICABLE = "not applicable: "
