"""What the exporter checks test an exporter on: the modules it claims, and its own examples.

Internal to :mod:`pytest_exportcheck.checks.exporters`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from exportlm.module_exporters import ExportModuleRegistry, ModuleExporter
from pytest_exportcheck.checks._api import CheckResult, ExporterCase
from pytest_exportcheck.checks._common import CheckAbort, error_text
from pytest_exportcheck.checks._survey import Survey

__all__ = [
    "EXAMPLES_HOOK",
    "Mismatch",
    "claimed_examples",
    "hook_examples",
    "describe_exporter",
    "no_examples",
    "run_property",
    "string_keys",
]

#: Name of the optional exporter method returning example modules it claims.
EXAMPLES_HOOK = "conformance_examples"


class Mismatch(AssertionError):
    """A property of a Hypothesis-driven check does not hold."""


def hook_examples(case: ExporterCase, exporter: ModuleExporter) -> list[nn.Module]:
    """The modules the exporter's ``conformance_examples()`` returns (none without one)."""
    hook = getattr(exporter, EXAMPLES_HOOK, None)
    if hook is None:
        return []
    try:
        found = list(hook())
    except Exception as err:
        raise CheckAbort(
            CheckResult.failed(
                f"{case.name}.{EXAMPLES_HOOK}() raised {error_text(err)}", exception=err
            )
        ) from err
    bad = [type(e).__name__ for e in found if not isinstance(e, nn.Module)]
    if bad:
        raise CheckAbort(
            CheckResult.failed(f"{case.name}.{EXAMPLES_HOOK}() returned non-modules: {bad}")
        )
    return found


def claimed_examples(
    case: ExporterCase, exporter: ModuleExporter, survey: Survey
) -> list[tuple[str, nn.Module]]:
    """``(label, module)`` claimed by the exporter: one per module type, then the hook's."""
    seen: set[type] = set()
    found: list[tuple[str, nn.Module]] = []
    for claim in survey.claims_of(case.name):
        if type(claim.module) not in seen:
            seen.add(type(claim.module))
            found.append((f"{claim.model}/{claim.recipe}:{claim.name}", claim.module))
    for i, module in enumerate(hook_examples(case, exporter)):
        found.append((f"{EXAMPLES_HOOK}()[{i}]", module))
    return found


def no_examples(case: ExporterCase, survey: Survey) -> CheckResult:
    """The skip of a check that needs examples when the exporter has none."""
    return CheckResult.skipped(
        f"module exporter {case.name!r} claims no module of the toy models "
        f"({', '.join(survey.models)} x each recipe) and has no {EXAMPLES_HOOK}() method"
    )


def run_property(prop: Callable[[], None]) -> str | None:
    """Run a Hypothesis-decorated property; the failure text, or ``None`` when it holds."""
    try:
        prop()
    except Mismatch as err:
        return str(err)
    return None


def describe_exporter(exporter: ModuleExporter | None) -> str:
    """``repr(exporter)``, or ``"no exporter"``."""
    return "no exporter" if exporter is None else repr(exporter)


def string_keys(registry: ExportModuleRegistry) -> set[str]:
    """Every class-name key of the dispatch ``registry``."""
    return {k for e in registry.entries() for k in e.keys if isinstance(k, str)}
