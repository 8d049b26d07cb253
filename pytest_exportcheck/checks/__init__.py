"""The conformance checks: plain functions returning a :class:`CheckResult`.

:data:`CHECKS` maps every check id to its :class:`CheckSpec`, in documentation
order: the built-in catalogue (:mod:`pytest_exportcheck.checks.catalogue`), then
any check added with :func:`register_check`. Each check is usable without
pytest::

    from pytest_exportcheck.checks import CHECKS, TargetCase

    case = TargetCase("onnx", None, {}, "decoder", "cpu", workdir=Path("/tmp/x"))
    result = CHECKS["roundtrip_logits"].fn(case)

``docs/checks.md`` lists every check with its scope, needs and typical failure.

Importing this package (or :mod:`~pytest_exportcheck.checks.catalogue`) imports
neither torch nor Hypothesis: a check's implementation module is imported the
first time its :attr:`CheckSpec.fn` is read. The implementation modules:

- :mod:`.targets` (``registration``, ``artifact``, ``roundtrip``, ``failures``,
  ``generation``, ``trust``, ``quantized``, ``checkpoint``, ``loadable``): target checks;
- :mod:`.exporters` (``dispatch``, ``order``, ``contract``, ``layout``, ``values``,
  ``golden``, ``fp8_gemm``): module-exporter checks;
- :mod:`.generated` (``roundtrip``, ``quantized``): the checks on structures
  drawn by Hypothesis.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pytest_exportcheck.checks._api import (
    CHECKS,
    CatalogueError,
    CheckResult,
    CheckSpec,
    ExporterCase,
    TargetCase,
    UnknownCheckError,
    check,
    get_check,
    register_check,
)
from pytest_exportcheck.checks._registries import Registries
from pytest_exportcheck.checks._services import CheckServices

if TYPE_CHECKING:
    from exportlm.export import LogitsComparison, compare_logits
    from pytest_exportcheck.checks import (
        exporters,
        generated,
        targets,
    )

__all__ = [
    "CHECKS",
    "CatalogueError",
    "CheckResult",
    "CheckServices",
    "CheckSpec",
    "ExporterCase",
    "LogitsComparison",
    "Registries",
    "TargetCase",
    "UnknownCheckError",
    "check",
    "compare_logits",
    "exporters",
    "generated",
    "get_check",
    "register_check",
    "targets",
]

#: Names imported on first access (they import torch): attribute -> module.
_LAZY_ATTRIBUTES = {
    "LogitsComparison": "exportlm.export",
    "compare_logits": "exportlm.export",
}
_LAZY_MODULES = frozenset({"exporters", "generated", "targets"})


def __getattr__(name: str) -> Any:
    """The torch-importing names of ``__all__``, imported when first asked for."""
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY_ATTRIBUTES:
        return getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
