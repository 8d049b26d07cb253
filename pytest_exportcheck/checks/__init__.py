"""The conformance check catalogue: plain functions returning a :class:`CheckResult`.

Importing this package registers every built-in check in :data:`CHECKS` (id ->
:class:`CheckSpec`, in documentation order). Each check is usable without
pytest::

    from pytest_exportcheck.checks import CHECKS, TargetCase

    case = TargetCase("onnx", None, {}, "decoder", "cpu", workdir=Path("/tmp/x"))
    result = CHECKS["roundtrip_logits"].fn(case)

``docs/checks.md`` lists every check with its scope, needs and typical failure.
This package imports torch; the pytest plugin imports it only when one of its
options is given.
"""

from exportlm.export._compare import LogitsComparison, compare_logits
from pytest_exportcheck.checks import (  # generated imports (registers after) targets
    checkpoint,
    exporters,
    generated,
    golden_checks,
    targets,
)
from pytest_exportcheck.checks._api import (
    CHECKS,
    CheckResult,
    CheckSpec,
    ExporterCase,
    TargetCase,
    check,
    get_check,
)

__all__ = [
    "CHECKS",
    "CheckResult",
    "CheckSpec",
    "ExporterCase",
    "LogitsComparison",
    "TargetCase",
    "check",
    "checkpoint",
    "compare_logits",
    "exporters",
    "generated",
    "get_check",
    "golden_checks",
    "targets",
]
