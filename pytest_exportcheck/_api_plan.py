"""Which items :mod:`pytest_exportcheck.api` parametrizes: names resolved against the registries.

Turns the names given to ``parametrize_with_checks`` / ``run_check`` into a
:class:`~pytest_exportcheck._collect.Plan` (the same pure planner the
``pytest --export-*`` suite uses) and collects the expected failures that apply.
Imported by ``api`` only when a decorator is built or a check runs: it imports
exportlm, and through it torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import pytest_exportcheck
from exportlm.errors import UnknownNameError
from exportlm.export import (
    EXPORT_REGISTRY,
    RUNTIME_REGISTRY,
    ensure_exporters_registered,
    get_target_info,
)
from exportlm.models import MODEL_REGISTRY, ensure_models_registered, model_expected_failures
from exportlm.module_exporters import EXPORT_MODULE_REGISTRY, ensure_module_exporters_registered
from pytest_exportcheck._collect import ExporterPlan, ItemSpec, Plan, TargetPlan, plan
from pytest_exportcheck._xfails import XfailBook, declared_book
from pytest_exportcheck.api import ExpectedFailures, Names
from pytest_exportcheck.checks import CHECKS, CheckSpec

__all__ = ["DEVICES", "Selection", "expected_failures", "single_item"]

#: Devices a check can run on.
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Selection:
    """Names resolved against what is installed, and the plan of their items."""

    plan: Plan
    target_names: tuple[str, ...]
    exporter_names: tuple[str, ...]

    @classmethod
    def resolve(
        cls, targets: Names, exporters: Names, models: Names, checks: Names | None, device: str
    ) -> Selection:
        """Resolve ``parametrize_with_checks``' arguments; an unknown name raises."""
        _check_device(device)
        target_names = _selected(targets, _target_names(), "export target")
        exporter_names = _selected(exporters, _exporter_names(), "module exporter")
        if not target_names and not exporter_names:
            raise ValueError(
                "parametrize_with_checks: select at least one export target or module "
                "exporter, e.g. targets=['onnx'], exporters=['quant_linear'] or targets='all'"
            )
        loaded_models, failed_models = _model_names()
        model_names = _selected(models, [*loaded_models, *failed_models], "model family")
        check_ids = set(_selected("all" if checks is None else checks, list(CHECKS), "check"))
        p = Plan(
            checks=tuple(spec for cid, spec in CHECKS.items() if cid in check_ids),
            targets=tuple(_target_plan(name) for name in target_names),
            exporters=_exporter_plans(exporter_names),
            extra_failures={
                f"model:{m}": failed_models[m] for m in model_names if m in failed_models
            },
            models=tuple(m for m in model_names if m in loaded_models),
            devices=(device,),
        )
        return cls(p, target_names, exporter_names)


def single_item(
    check_id: str, *, target: str | None, exporter: str | None, model: str | None, device: str
) -> ItemSpec:
    """The one item ``run_check`` runs: ``check_id`` on a target row or an exporter."""
    _check_device(device)
    if check_id not in CHECKS:
        raise UnknownNameError("check", check_id, list(CHECKS))
    spec = CHECKS[check_id]
    other = "exporter" if spec.scope == "target" else "target"
    given = {"target": target, "exporter": exporter}
    if given[spec.scope] is None or given[other] is not None:
        raise ValueError(
            f"check {check_id!r} is a {spec.scope} check: pass {spec.scope}=<name>, not {other}="
        )
    models = _model_argument(spec, model, spec.scope == "target")
    targets: tuple[TargetPlan, ...] = ()
    exporters: tuple[ExporterPlan, ...] = ()
    if target is not None:
        targets = (_target_row(target),)
    else:
        exporters = _exporter_plans(
            _selected([str(exporter)], _exporter_names(), "module exporter")
        )
    p = Plan(checks=(spec,), targets=targets, exporters=exporters, models=models, devices=(device,))
    (item,) = [i for i in plan(p) if i.check == check_id]
    return item


def expected_failures(selection: Selection, expected: ExpectedFailures | None) -> XfailBook:
    """Expected failures declared by the selected targets, exporters and model families, and by ``expected``.

    ``expected(name)`` is called once per selected target and exporter; an entry
    of it that matches no item of the selection (under any check) warns.
    """
    book = declared_book(
        {t.name: get_target_info(t.name) for t in selection.plan.targets if t.loaded},
        {e.name: EXPORT_MODULE_REGISTRY.get(e.name) for e in selection.plan.exporters if e.loaded},
        {m: model_expected_failures(m) for m in selection.plan.models},
    )
    if expected is None:
        return book
    own = XfailBook()
    for name in (*selection.target_names, *selection.exporter_names):
        own.add(_declared(expected, name), source="expected_failed_checks", scope=name)
    _warn_unmatched(own, selection)
    book.extend(own.rules)
    return book


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")


def _selected(value: Names, available: Iterable[str], kind: str) -> tuple[str, ...]:
    """``value`` resolved: ``"all"`` -> every available name; an unknown name raises."""
    known = sorted(set(available))
    names = [value] if isinstance(value, str) else list(value)
    if names == ["all"]:
        return tuple(known)
    for name in names:
        if name not in known:
            raise UnknownNameError(kind, name, known)
    return tuple(sorted(set(names)))


def _target_names() -> list[str]:
    ensure_exporters_registered()
    return [*EXPORT_REGISTRY.names(), *EXPORT_REGISTRY.failed()]


def _exporter_names() -> list[str]:
    ensure_module_exporters_registered()
    return [*EXPORT_MODULE_REGISTRY.names(), *EXPORT_MODULE_REGISTRY.failed()]


def _model_names() -> tuple[list[str], dict[str, str]]:
    """Loaded toy families, and the load error of each family whose plugin failed."""
    ensure_models_registered()
    return MODEL_REGISTRY.names(), {n: str(e) for n, e in MODEL_REGISTRY.failed().items()}


def _target_plan(name: str) -> TargetPlan:
    """Target ``name``: one row per declared variant; a failed plugin is its plugin_loads."""
    failed = EXPORT_REGISTRY.failed().get(name)
    if failed is not None:
        return TargetPlan(name, failure=str(failed), loaded=False)
    info = get_target_info(name)
    runtime_failure = RUNTIME_REGISTRY.failed().get(info.runtime)
    rows = tuple((v, dict(info.variants[v])) for v in sorted(info.variants)) or ((None, {}),)
    failure = None if runtime_failure is None else f"runtime: {runtime_failure}"
    return TargetPlan(name, rows, info.capabilities, failure=failure)


def _target_row(target_id: str) -> TargetPlan:
    """``name`` (default options) or ``name:variant`` as a one-row :class:`TargetPlan`."""
    name, _, variant = target_id.partition(":")
    (name,) = _selected([name], _target_names(), "export target")
    info = get_target_info(name)
    if variant and variant not in info.variants:
        raise UnknownNameError(f"variant of target {name!r}", variant, list(info.variants))
    kwargs = dict(info.variants[variant]) if variant else {}
    return TargetPlan(name, ((variant or None, kwargs),), info.capabilities)


def _exporter_plans(names: Iterable[str]) -> tuple[ExporterPlan, ...]:
    failed = EXPORT_MODULE_REGISTRY.failed()
    return tuple(
        ExporterPlan(n, str(failed[n]) if n in failed else None, loaded=n not in failed)
        for n in names
    )


def _model_argument(spec: CheckSpec, model: str | None, target: bool) -> tuple[str, ...]:
    """The plan's models for ``run_check``: the one family of a per-model check."""
    loaded, _ = _model_names()
    if model is not None:
        _selected([model], loaded, "model family")
    if spec.per_model and model is None:
        raise ValueError(
            f"check {spec.id!r} runs per model: pass model=<family> ({', '.join(loaded)})"
        )
    if target and not spec.per_model and model is not None:
        raise ValueError(f"check {spec.id!r} is not run per model: drop model={model!r}")
    return (model,) if model is not None and spec.per_model else ()


def _declared(expected: ExpectedFailures, name: str) -> Mapping[str, str]:
    declared = expected(name)
    if not isinstance(declared, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in declared.items()
    ):
        raise TypeError(
            f"expected_failed_checks({name!r}) returned {declared!r}; expected a mapping "
            "{check id or item-id pattern: non-empty reason}, e.g. "
            '{"roundtrip_logits": "fp16 drift beyond tolerance"}'
        )
    return declared


def _warn_unmatched(book: XfailBook, selection: Selection) -> None:
    """Warn about each rule that matches no item of the selection under any check."""
    every = replace(selection.plan, checks=tuple(CHECKS.values()))
    universe = [(i.name, i.check, i.column) for i in plan(every)]
    for rule in book.unmatched(universe):
        warnings.warn(
            pytest_exportcheck.ExportCheckWarning(
                f"expected failure {rule.pattern!r} (expected_failed_checks({rule.scope!r})) "
                "matches no item; fix the check id or item-id pattern, or remove the entry"
            ),
            stacklevel=4,
        )
