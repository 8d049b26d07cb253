"""Exporter checks of what a dispatch entry claims: by MRO, by exact name, by predicate."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from hypothesis import given
from torch import nn

from exportlm.module_exporters import ExporterEntry, ExportModuleRegistry, ModuleExporter
from pytest_exportcheck.checks._api import CheckResult, ExporterCase, check
from pytest_exportcheck.checks._common import aborts_to_result, listed
from pytest_exportcheck.checks._survey import Survey, copy_registry, exporter_entry, survey_for
from pytest_exportcheck.checks.exporters._examples import (
    Mismatch,
    claimed_examples,
    describe_exporter,
    no_examples,
    run_property,
    string_keys,
)
from pytest_exportcheck.strategies import model_settings, module_class_trees, reclass

__all__ = ["mro_match", "name_match", "predicate_match"]

#: Generated classes per example type in ``mro_match`` (twice as many in ``name_match``).
_EXAMPLES_PER_TYPE = 20


def _subclass_property(
    registry: Any, exporter: ModuleExporter, module: nn.Module, label: str, avoid: set[str]
) -> Callable[[], None]:
    @model_settings(max_examples=_EXAMPLES_PER_TYPE, database=None)
    @given(module_class_trees([type(module)], avoid=avoid))
    def prop(cls: type) -> None:
        got = registry.match(reclass(module, cls))
        if got is not exporter:
            mro = " -> ".join(c.__name__ for c in cls.__mro__[:6])
            raise Mismatch(
                f"a subclass {cls.__name__} of {type(module).__name__} ({label}; MRO {mro}) "
                f"is dispatched to {describe_exporter(got)}, not {exporter!r}"
            )

    return prop  # type: ignore[no-any-return]


@check("mro_match")
@aborts_to_result
def mro_match(case: ExporterCase) -> CheckResult:
    """Generated subclasses of every module type the exporter claims are still claimed by it.

    For each claimed type, Hypothesis builds chains of new subclasses (random
    names, some with a mixin, never a name any entry uses as a key) and moves an
    instance onto them: dispatch must still pick this exporter, since a class key
    matches anywhere in the MRO and a name key matches the original class's name
    there. Fails with the falsifying class and the exporter it went to instead.
    """
    exporter, _, _ = exporter_entry(case)
    survey = survey_for(case)
    examples = claimed_examples(case, exporter, survey)
    if not examples:
        return no_examples(case, survey)
    registry = copy_registry(case.services.registries.module_exporters)
    avoid = string_keys(registry)
    for where, module in examples:
        failure = run_property(_subclass_property(registry, exporter, module, where, avoid))
        if failure:
            return CheckResult.failed(failure)
    return CheckResult.passed(
        f"{len(examples)} claimed type(s), generated subclasses still claimed"
    )


# ----------------------------------------------------------------------------- name_match


_NEUTRAL_BASES: tuple[type[nn.Module], ...] = (nn.Module, nn.Identity)


def _neutral_bases(entry: ExporterEntry) -> list[type[nn.Module]]:
    """Bases none of the entry's keys match (so only a substring bug could match them)."""
    bases = []
    for base in _NEUTRAL_BASES:
        names = {c.__name__ for c in base.__mro__}
        if any((k in base.__mro__) if isinstance(k, type) else (k in names) for k in entry.keys):
            continue
        bases.append(base)
    return bases


@check("name_match")
@aborts_to_result
def name_match(case: ExporterCase) -> CheckResult:
    """Class names are matched exactly: a name merely containing a key is not claimed.

    Hypothesis generates unrelated module classes (subclasses of ``nn.Module`` /
    ``nn.Identity`` that no key of the entry matches) whose names embed the
    exporter's string keys, its class keys' names and the names of the types it
    claims, e.g. ``MyQuantLinearV2`` or ``QuantLinearMoE``. None may be claimed by
    this exporter: dispatch on ``"QuantLinear" in type(m).__name__`` fails here,
    whether it hides in a key or in a predicate.
    """
    exporter, entry, _ = exporter_entry(case)
    survey = survey_for(case)
    words = {k if isinstance(k, str) else k.__name__ for k in entry.keys}
    words |= {type(m).__name__ for _, m in claimed_examples(case, exporter, survey)}
    if not words:
        return CheckResult.skipped(
            f"module exporter {case.name!r} has no keys and claims no module: no name to test"
        )
    bases = _neutral_bases(entry)
    if not bases:
        return CheckResult.skipped(f"{entry.describe()} matches every nn.Module by its keys")
    registry = copy_registry(case.services.registries.module_exporters)

    @model_settings(max_examples=2 * _EXAMPLES_PER_TYPE, database=None)
    @given(module_class_trees(bases, contains=sorted(words), avoid=string_keys(registry) | words))
    def prop(cls: type) -> None:
        got = registry.match(cls())
        if got is exporter:
            raise Mismatch(
                f"{exporter!r} claims {cls.__name__} (MRO "
                f"{', '.join(c.__name__ for c in cls.__mro__)}), which only contains one of "
                f"{sorted(words)} as a substring; match class names exactly, never by substring"
            )

    failure = run_property(prop)
    if failure:
        return CheckResult.failed(failure)
    return CheckResult.passed(f"names embedding {sorted(words)} are not claimed")


# ----------------------------------------------------------------------------- predicate_match


def _all_modules(
    survey: Survey, examples: list[tuple[str, nn.Module]]
) -> Iterable[tuple[str, nn.Module]]:
    for q in survey.quantized:
        for name, module in q.model.named_modules():
            yield f"{q.model_name}/{q.recipe}:{name}", module
    yield from examples


class _PredicateTally:
    """Counts and problems of ``predicate_match``, with the first exception a predicate raised."""

    def __init__(
        self,
        registry: ExportModuleRegistry,
        entry: ExporterEntry,
        exporter: ModuleExporter,
        predicate: Callable[[nn.Module], Any],
    ) -> None:
        self.entry, self.exporter, self.predicate = entry, exporter, predicate
        self.single = copy_registry(registry, [entry])
        self.counts = {"keys": 0, "predicate": 0, "claimed": 0}
        self.problems: list[str] = []
        self.exception: BaseException | None = None

    def visit(self, where: str, module: nn.Module) -> None:
        """Dispatch ``module`` through a registry holding only the entry, against keys and predicate."""
        predicate = self.predicate
        keys_ok = self.entry.keys_match(type(module))
        self.counts["keys"] += keys_ok
        if not keys_ok:
            if self.single.match(module) is self.exporter:
                self.problems.append(
                    f"{where}: claimed although no key matches {type(module).__name__}"
                )
            return
        try:
            first, second = bool(predicate(module)), bool(predicate(module))
        except Exception as err:
            self.problems.append(f"{where}: the predicate raised {type(err).__name__}: {err}")
            self.exception = self.exception or err
            return
        if first != second:
            self.problems.append(f"{where}: the predicate answered {first} then {second}")
        self.counts["predicate"] += first
        claimed = self.single.match(module) is self.exporter
        self.counts["claimed"] += claimed
        if claimed != first:
            self.problems.append(
                f"{where}: keys match, predicate is {first}, but claimed={claimed}"
            )


@check("predicate_match")
@aborts_to_result
def predicate_match(case: ExporterCase) -> CheckResult:
    """An entry with a predicate claims a module only when keys and predicate both match.

    For every module of every quantized toy model (and the exporter's examples),
    a registry holding only this entry must claim it exactly when some key
    matches (or there are no keys) *and* the predicate returns true. The
    predicate must not raise on a module its keys select (for a predicate-only
    entry: on any module) and must give the same answer twice.
    """
    exporter, entry, _ = exporter_entry(case)
    if entry.predicate is None:
        return CheckResult.skipped(f"{entry.describe()} has no predicate; keys alone decide")
    survey = survey_for(case)
    registry = case.services.registries.module_exporters
    tally = _PredicateTally(registry, entry, exporter, entry.predicate)
    for where, module in _all_modules(survey, claimed_examples(case, exporter, survey)):
        tally.visit(where, module)
    counts = tally.counts
    if tally.problems:
        return CheckResult.failed(
            f"{entry.describe()}: {listed(tally.problems)}", exception=tally.exception, **counts
        )
    return CheckResult.passed(
        f"{counts['keys']} key matches, {counts['predicate']} accepted by the predicate, "
        f"{counts['claimed']} claimed",
        **counts,
    )
