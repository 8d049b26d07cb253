"""``parametrize_with_checks`` / ``run_check`` arguments -> a request for the one planner.

The API plans through the same :class:`~pytest_exportcheck.plan.Planner` and
discovery record as the suite; this module only turns its keyword arguments into
a :class:`~pytest_exportcheck.plan.PlanRequest`, checks the arguments the suite
has no twin of (one device, one check for ``run_check``) and adds the
``expected_failed_checks`` rules. An unknown name raises
:class:`~exportlm.errors.UnknownNameError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pytest_exportcheck.plan._discovery import Discovery
from pytest_exportcheck.plan._items import ItemSpec, Plan, TargetPlan, plan
from pytest_exportcheck.plan._planner import Planner
from pytest_exportcheck.plan._selection import DEVICES, NameSelection, PlanRequest
from pytest_exportcheck.plan._xfails import XfailBook

if TYPE_CHECKING:
    from pytest_exportcheck.api import ExpectedFailures, Names
    from pytest_exportcheck.checks import CheckSpec

__all__ = ["ApiSelection", "api_planner", "expected_failures", "single_item"]


def _unknown_name(
    what: str, option: str, missing: Sequence[str], known: Sequence[str]
) -> Exception:
    from exportlm.errors import UnknownNameError

    return UnknownNameError(what, missing[0], list(known))


def api_planner(
    discovery: Discovery, checks: Mapping[str, CheckSpec], catalogue: int | None = None
) -> Planner:
    """The planner as the API uses it: unknown names raise ``UnknownNameError``.

    ``catalogue`` pins a catalogue version as ``exportcheck_catalogue`` does; a
    ``catalogue`` that is no version raises ``ValueError``.
    """
    from pytest_exportcheck.checks.versions import CATALOGUE_VERSION

    if catalogue is not None and (
        isinstance(catalogue, bool)
        or not isinstance(catalogue, int)
        or not 1 <= catalogue <= CATALOGUE_VERSION
    ):
        raise ValueError(
            f"catalogue={catalogue!r}: expected None or a catalogue version from 1 to "
            f"{CATALOGUE_VERSION} (docs/checks.md, 'Catalogue versions')"
        )
    return Planner(discovery, checks, unknown=_unknown_name, catalogue=catalogue)


@dataclass(frozen=True)
class ApiSelection:
    """``parametrize_with_checks``' names resolved against what is installed, and their plan."""

    plan: Plan
    target_names: tuple[str, ...]
    exporter_names: tuple[str, ...]
    models: NameSelection

    @classmethod
    def resolve(
        cls,
        planner: Planner,
        targets: Names,
        exporters: Names,
        models: Names,
        checks: Names | None,
        device: str,
    ) -> ApiSelection:
        """Resolve ``parametrize_with_checks``' arguments; an unknown name raises."""
        check_device(device)
        request = PlanRequest(
            NameSelection.of(targets),
            NameSelection.of(exporters),
            NameSelection.of(models),
            NameSelection.of("all" if checks is None else checks),
            (device,),
        )
        p = planner.plan(request)
        if not p.targets and not p.exporters:
            raise ValueError(
                "parametrize_with_checks: select at least one export target or module "
                "exporter, e.g. targets=['onnx'], exporters=['quant_linear'] or targets='all'"
            )
        target_names = tuple(t.name for t in p.targets)
        exporter_names = tuple(e.name for e in p.exporters)
        return cls(p, target_names, exporter_names, request.models)


def single_item(
    planner: Planner,
    check_id: str,
    *,
    target: str | None,
    exporter: str | None,
    model: str | None,
    device: str,
) -> ItemSpec:
    """The one item ``run_check`` runs: ``check_id`` on a target row or an exporter."""
    from exportlm.errors import UnknownNameError

    check_device(device)
    checks = planner.checks
    newer = planner.pinned_out(check=check_id)
    if newer is not None:
        message = planner.pin_message(f"check {check_id!r}", newer)
        raise UnknownNameError("check", check_id, list(checks), detail=message)
    if check_id not in checks:
        raise UnknownNameError("check", check_id, list(checks))
    spec = checks[check_id]
    other = "exporter" if spec.scope == "target" else "target"
    given = {"target": target, "exporter": exporter}
    if given[spec.scope] is None or given[other] is not None:
        raise ValueError(
            f"check {check_id!r} is a {spec.scope} check: pass {spec.scope}=<name>, not {other}="
        )
    models = _model_argument(planner, spec, model, spec.scope == "target")
    request = PlanRequest(checks=NameSelection.of([check_id]), models=NameSelection.of(models))
    if target is not None:
        p = replace(planner.plan(request), targets=(_target_row(planner, target),))
    else:
        p = planner.plan(replace(request, exporters=NameSelection.of([str(exporter)])))
    # One result: a per-engine check (served) runs every engine that takes the target's output;
    # a check that cannot apply is asked for by name: its one item skips with the reason.
    one = tuple(replace(s, per_engine=False) for s in p.checks)
    p = replace(p, checks=one, devices=(device,), extra_failures={}, keep_inapplicable=True)
    (item,) = [i for i in plan(p) if i.check == check_id]
    return item


def expected_failures(
    planner: Planner, selection: ApiSelection, expected: ExpectedFailures | None
) -> XfailBook:
    """Expected failures declared by the selected targets, exporters and models, and by ``expected``.

    ``expected(name)`` is called once per selected target and exporter; an entry
    of it that matches no item of the selection (under any check) warns.
    """
    book = planner.xfail_book(only=selection.plan)
    if expected is None:
        return book
    own = XfailBook()
    for name in (*selection.target_names, *selection.exporter_names):
        own.add(_declared(expected, name), source="expected_failed_checks", scope=name)
    every = replace(selection.plan, checks=tuple(planner.checks.values()))
    _warn_unmatched(planner, own, every)
    book.extend(own.rules)
    return book


def check_device(device: str) -> None:
    """A device the API runs on (one; the suite takes several)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")


def _target_row(planner: Planner, target_id: str) -> TargetPlan:
    """``name`` (default options) or ``name:variant`` as a one-row :class:`TargetPlan`."""
    from exportlm.errors import UnknownNameError

    name, _, variant = target_id.partition(":")
    targets = planner.discovery.targets
    if name not in targets:
        raise UnknownNameError("export target", name, sorted(targets))
    info = targets[name]
    if variant and variant not in info.variants:
        raise UnknownNameError(f"variant of target {name!r}", variant, list(info.variants))
    kwargs = dict(info.variants[variant]) if variant else {}
    return TargetPlan(name, ((variant or None, kwargs),), info.capabilities, artifact=info.artifact)


def _model_argument(
    planner: Planner, spec: CheckSpec, model: str | None, target: bool
) -> tuple[str, ...]:
    """The plan's models for ``run_check``: the one family of a per-model check."""
    from exportlm.errors import UnknownNameError

    loaded = list(planner.discovery.models)
    newer = None if model is None else planner.pinned_out(model=model)
    if newer is not None:
        message = planner.pin_message(f"model family {model!r}", newer)
        raise UnknownNameError("model family", str(model), loaded, detail=message)
    if model is not None and model not in loaded:
        raise UnknownNameError("model family", model, loaded)
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


def _warn_unmatched(planner: Planner, book: XfailBook, within: Plan) -> None:
    """Warn about each rule that matches no item of the selection under any check."""
    from pytest_exportcheck._warnings import ExportCheckWarning

    for rule in planner.unmatched(book, within):
        warnings.warn(
            ExportCheckWarning(
                f"expected failure {rule.pattern!r} (expected_failed_checks({rule.scope!r})) "
                "matches no item; fix the check id or item-id pattern, or remove the entry"
            ),
            stacklevel=4,
        )
