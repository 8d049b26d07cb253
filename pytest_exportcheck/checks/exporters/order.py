"""Exporter checks of where a dispatch entry sits: ``precedence`` and ``reachable``."""

from __future__ import annotations

from typing import Any

from torch import nn

from exportlm.module_exporters import ExportContext, ExporterEntry, ModuleExporter
from pytest_exportcheck.checks._api import CheckResult, ExporterCase, check
from pytest_exportcheck.checks._common import aborts_to_result
from pytest_exportcheck.checks._survey import copy_registry, exporter_entry, survey_for
from pytest_exportcheck.checks.exporters._examples import claimed_examples

__all__ = ["precedence", "reachable"]


def _probe(entry: ExporterEntry) -> ModuleExporter:
    """A fresh exporter of its own class, with the same keys as ``entry``."""

    class PrecedenceProbe(ModuleExporter):
        name = "exportcheck_precedence_probe"

        def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
            return None

    return PrecedenceProbe()


@check("precedence")
@aborts_to_result
def precedence(case: ExporterCase) -> CheckResult:
    """Order is stable; re-registration replaces in place; ``prepend`` goes first.

    On copies of the registry: a copy keeps the order; registering the exporter
    again keeps its position and the number of entries; a probe exporter with the
    same keys registered with ``prepend=True`` becomes entry 0 and wins every
    module the exporter claims, while appended it wins none of them (first match
    wins).
    """
    exporter, entry, index = exporter_entry(case)
    survey = survey_for(case)
    modules = [m for _, m in claimed_examples(case, exporter, survey)]
    dispatch = case.services.registries.module_exporters
    registry = copy_registry(dispatch)
    order = registry.exporters()
    problems: list[str] = []
    if order != copy_registry(dispatch).exporters():
        problems.append("two copies of the registry list the exporters in different orders")
    registry.register(exporter, *entry.keys, predicate=entry.predicate)
    if registry.exporters() != order:
        problems.append(f"registering {exporter!r} again moved it or added an entry")
    probe = _probe(entry)
    registry.register(probe, *entry.keys, predicate=entry.predicate, prepend=True)
    if registry.exporters()[0] is not probe or registry.exporters()[index + 1] is not exporter:
        problems.append("prepend=True did not put the new entry first, before all others")
    registry.register(exporter, *entry.keys, predicate=entry.predicate)
    if registry.exporters()[index + 1] is not exporter:
        problems.append("an in-place replacement after a prepend moved the exporter")
    stolen = [type(m).__name__ for m in modules if registry.match(m) is not probe]
    if stolen:
        problems.append(f"a prepended entry with the same keys did not win {stolen}")
    appended = copy_registry(dispatch)
    appended.register(probe, *entry.keys, predicate=entry.predicate)
    if appended.exporters()[-1] is not probe:
        problems.append("a new entry was not appended last")
    lost = [type(m).__name__ for m in modules if appended.match(m) is not exporter]
    if lost:
        problems.append(
            f"an appended entry with the same keys took {lost} away (first match must win)"
        )
    if problems:
        return CheckResult.failed(f"{entry.describe()}: " + "; ".join(problems))
    note = f" on {len(modules)} claimed type(s)" if modules else " (order only: no claimed module)"
    return CheckResult.passed(f"entry {index}: order, replacement and prepend honoured{note}")


def _covers(earlier: ExporterEntry, key: Any) -> bool:
    """Whether every module matched by ``key`` is also matched by ``earlier``'s keys."""
    if earlier.predicate is not None or not earlier.keys:
        return False
    if isinstance(key, type):
        names = {c.__name__ for c in key.__mro__}
        return any(k in key.__mro__ if isinstance(k, type) else k in names for k in earlier.keys)
    return key in earlier.keys


@check("reachable")
@aborts_to_result
def reachable(case: ExporterCase) -> CheckResult:
    """The exporter is not fully shadowed by earlier entries for its own keys.

    Passes when it claims some module of the toy models or its examples. Otherwise
    each of its keys must not be covered by an earlier predicate-free entry (a class
    key is covered by an earlier key in its MRO, a name key by the same name
    earlier); if all are, no module can ever reach it and the check fails naming
    the shadowing entries.
    """
    _, entry, index = exporter_entry(case)
    survey = survey_for(case)
    claims = survey.claims_of(case.name)
    if claims:
        return CheckResult.passed(f"claims {len(claims)} module(s) of the toy models")
    earlier = copy_registry(case.services.registries.module_exporters).entries()[:index]
    shadows: dict[str, str] = {}
    for key in entry.keys:
        for other in earlier:
            if _covers(other, key):
                shadows[key if isinstance(key, str) else key.__name__] = other.describe()
                break
    if entry.keys and len(shadows) == len(entry.keys):
        return CheckResult.failed(
            f"{entry.describe()} (entry {index}) is unreachable: every key is taken first by "
            + "; ".join(f"{k!r} by {v}" for k, v in shadows.items())
            + ". Register it with prepend=True, or narrow the earlier entry with a predicate"
        )
    return CheckResult.passed(f"entry {index} is not shadowed (it claims no toy-model module)")
