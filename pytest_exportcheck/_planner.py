"""Which items exist: discovery + options + node-id arguments + expected failures -> items.

:class:`SuitePlanner` resolves the ``--export-*`` selection against what
:func:`~pytest_exportcheck._discovery.discover` found, hands the result to the
pure :func:`~pytest_exportcheck._collect.plan`, narrows it to the suite's node
ids given on the command line, and gathers the expected failures declared by
targets, module exporters and the xfails file. It imports exportlm (and torch).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

import pytest

from pytest_exportcheck import ExportCheckWarning
from pytest_exportcheck._collect import PLUGIN_LOADS, ExporterPlan, ItemSpec, Plan, TargetPlan, plan
from pytest_exportcheck._discovery import Discovery, PluginFailure
from pytest_exportcheck._nodeids import ROOT, SuiteArgs
from pytest_exportcheck._options import DEVICES, Options, Selection
from pytest_exportcheck._xfails import XfailBook, declared_book, load_xfails_file
from pytest_exportcheck.checks import CheckSpec

__all__ = ["SuitePlanner"]

_KINDS = ("target", "runtime", "module exporter", "model family")
#: ``kind -> name -> failures`` of the plugins that failed to load.
_Failed = Mapping[str, Mapping[str, list[PluginFailure]]]


@dataclass(frozen=True)
class _Wanted:
    """A name selection for each axis of the plan."""

    targets: Selection
    exporters: Selection
    models: Selection
    checks: Selection
    devices: tuple[str, ...]


class SuitePlanner:
    """Plans the run's items from the options, the registries and the command line."""

    def __init__(
        self, options: Options, discovery: Discovery, checks: Mapping[str, CheckSpec]
    ) -> None:
        self.options = options
        self.discovery = discovery
        self.checks = checks
        self._failed: _Failed = {kind: self._failures(kind) for kind in _KINDS}

    # -- plans --------------------------------------------------------------
    def selection(self) -> Plan:
        """The plan of the ``--export-*`` selection (everything when no target or exporter is)."""
        return self._plan(self._selected())

    def everything(self) -> Plan:
        """The plan of every item that could exist: all names, checks and devices."""
        everything = Selection(all=True)
        return self._plan(_Wanted(everything, everything, everything, everything, DEVICES))

    def items(self, args: SuiteArgs) -> list[ItemSpec]:
        """The run's items: the selection's, or those the suite's node-id arguments name.

        ``exportcheck`` names the selection's items; ``exportcheck::<check>`` the
        items of that check over the selected targets, exporters, models and
        devices; an item id names that item whatever the selection (like a test
        path on the command line, which pytest collects whatever ``testpaths``
        says). Order is plan order.
        """
        if not args:
            return plan(self.selection())
        chosen = {s.name for s in plan(self.selection())} if args.whole else set()
        if args.checks:
            unknown = sorted(args.checks - set(self.checks) - {PLUGIN_LOADS})
            if unknown:
                raise pytest.UsageError(
                    f"{', '.join(f'{ROOT}::{c}' for c in unknown)}: no such check; "
                    f"available: {', '.join(self.checks)}"
                )
            wanted = self._plan(self._selected(checks=Selection(all=True)))
            chosen |= {s.name for s in plan(wanted) if s.check in args.checks}
        universe = plan(self.everything())
        self._require_known(args, {s.name for s in universe})
        chosen |= args.item_ids
        return [s for s in universe if s.name in chosen]

    def _selected(self, checks: Selection | None = None) -> _Wanted:
        """The options' selection; every target and exporter while the options select none."""
        o = self.options
        everything = Selection(all=True)
        return _Wanted(
            o.target_selection if o.active else everything,
            o.exporter_selection if o.active else everything,
            o.models,
            checks or o.checks,
            o.devices,
        )

    @staticmethod
    def _require_known(args: SuiteArgs, known: set[str]) -> None:
        for item, arg in args.items:
            if item in known:
                continue
            close = difflib.get_close_matches(item, sorted(known), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise pytest.UsageError(
                f"{arg}: no such exportcheck item among every installed target, exporter, "
                f"model family and device{hint}"
            )

    def _plan(self, wanted: _Wanted) -> Plan:
        d, failed = self.discovery, self._failed
        targets = wanted.targets.resolve(
            [*d.targets, *failed["target"]], what="export target", option="--export-targets"
        )
        exporters = wanted.exporters.resolve(
            [*d.exporters, *failed["module exporter"]],
            what="module exporter",
            option="--export-exporters",
        )
        models = wanted.models.resolve(
            [*d.models, *failed["model family"]], what="model family", option="--export-models"
        )
        check_ids = wanted.checks.resolve(
            [*self.checks, PLUGIN_LOADS], what="check", option="--export-checks"
        )
        return Plan(
            checks=tuple(spec for c, spec in self.checks.items() if c in check_ids),
            targets=tuple(self._target_plan(t) for t in targets),
            exporters=tuple(self._exporter_plan(e) for e in exporters),
            extra_failures=(
                self._extra_failures(targets, models, every_runtime=wanted.targets.all)
                if PLUGIN_LOADS in check_ids
                else {}
            ),
            models=tuple(m for m in models if m in d.models),
            devices=wanted.devices,
        )

    def _failures(self, kind: str) -> dict[str, list[PluginFailure]]:
        out: dict[str, list[PluginFailure]] = {}
        for failure in self.discovery.failures:
            if failure.kind == kind:
                out.setdefault(failure.name, []).append(failure)
        return out

    def _extra_failures(
        self, targets: list[str], models: list[str], *, every_runtime: bool
    ) -> dict[str, str]:
        """Failing plugin_loads of selected model families and of runtimes no target uses."""
        d, failed = self.discovery, self._failed
        used = {d.targets[t].runtime for t in targets if t in d.targets}
        extra = {
            f"model:{m}": _failure_text(failed["model family"][m])
            for m in models
            if m in failed["model family"]
        }
        if every_runtime:
            extra |= {
                f"runtime:{r}": _failure_text(fs)
                for r, fs in failed["runtime"].items()
                if r not in used
            }
        return {k: v for k, v in extra.items() if v is not None}

    def _target_plan(self, name: str) -> TargetPlan:
        failed = self._failed
        if name not in self.discovery.targets:
            return TargetPlan(name, failure=_failure_text(failed["target"][name]), loaded=False)
        info = self.discovery.targets[name]
        problems = [*failed["target"].get(name, []), *failed["runtime"].get(info.runtime, [])]
        rows = tuple((row.variant, row.export_kwargs) for row in self.discovery.rows(name))
        return TargetPlan(name, rows, info.capabilities, failure=_failure_text(problems))

    def _exporter_plan(self, name: str) -> ExporterPlan:
        failure = _failure_text(self._failed["module exporter"].get(name, []))
        return ExporterPlan(name, failure, loaded=name in self.discovery.exporters)

    # -- expected failures --------------------------------------------------
    def xfail_book(self) -> XfailBook:
        """Expected failures declared by targets, exporters, model families and the xfails file."""
        from exportlm.models import model_expected_failures

        models = {m: model_expected_failures(m) for m in self.discovery.models}
        try:
            book = declared_book(self.discovery.targets, self.discovery.exporters, models)
        except TypeError as err:
            raise pytest.UsageError(str(err)) from err
        if self.options.xfails_file is not None:
            book.extend(load_xfails_file(self.options.xfails_file))
        return book

    def warn_unmatched(self, config: pytest.Config, book: XfailBook) -> None:
        """Warn (a usage error under ``-W error``) about rules that match no possible item."""
        universe = [(s.name, s.check, s.column) for s in plan(self.everything())]
        for rule in book.unmatched(universe):
            warning = ExportCheckWarning(
                f"expected failure {rule.pattern!r} ({rule.source}) matches no exportcheck "
                "item; fix the check id or item id pattern, or remove the entry"
            )
            try:
                config.issue_config_time_warning(warning, stacklevel=2)
            except ExportCheckWarning as err:  # -W error::...ExportCheckWarning
                raise pytest.UsageError(str(err)) from err


def _failure_text(failures: list[PluginFailure]) -> str | None:
    """The messages of ``failures``, one per line; ``None`` when there are none."""
    return "\n".join(f.message for f in failures) or None
