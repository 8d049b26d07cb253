"""Which conformance items exist: the plan package (pure; imports no torch).

Discovery (:func:`discover`, the only reader of exportlm's registries; it imports
exportlm when called), requests and name selections, the one :class:`Planner`
behind both the ``pytest --export-*`` suite and ``parametrize_with_checks``, the
pure :func:`plan` from resolved names to :class:`ItemSpec` records, expected
failures (:class:`XfailBook`), node ids, and the typed :class:`CaseOptions` a check
sees. Nothing here imports the run package or the pytest layer.
"""

from __future__ import annotations

from pytest_exportcheck.plan._applicability import NotApplicable
from pytest_exportcheck.plan._case_options import CaseOptions, case_options
from pytest_exportcheck.plan._discovery import (
    Discovery,
    InstalledPlugin,
    PluginFailure,
    TargetRow,
    discover,
)
from pytest_exportcheck.plan._items import (
    PLUGIN_LOADS,
    ExporterPlan,
    ItemSpec,
    Plan,
    TargetPlan,
    not_applicable,
    plan,
)
from pytest_exportcheck.plan._planner import Planner
from pytest_exportcheck.plan._selection import DEVICES, NameSelection, PlanRequest
from pytest_exportcheck.plan._xfails import XfailBook, XfailRule

__all__ = [
    "DEVICES",
    "PLUGIN_LOADS",
    "CaseOptions",
    "Discovery",
    "ExporterPlan",
    "InstalledPlugin",
    "ItemSpec",
    "NameSelection",
    "NotApplicable",
    "Plan",
    "PlanRequest",
    "PluginFailure",
    "Planner",
    "TargetPlan",
    "TargetRow",
    "XfailBook",
    "XfailRule",
    "case_options",
    "discover",
    "not_applicable",
    "plan",
]
