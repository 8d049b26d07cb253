"""The one planner: a discovery record + a request (+ node-id arguments) -> the items.

:class:`Planner` resolves a :class:`~pytest_exportcheck.plan.PlanRequest` against
what :func:`~pytest_exportcheck.plan.discover` found, hands the result to the pure
:func:`~pytest_exportcheck.plan.plan`, narrows it to the suite's node ids given on
the command line, and gathers the expected failures declared by targets, module
exporters and model families. The ``pytest --export-*`` suite and
``parametrize_with_checks`` / ``run_check`` both plan through it; they differ only in
the error an unknown name raises (a usage error naming the option, or
:class:`~exportlm.errors.UnknownNameError`). It never reads a registry itself.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from pytest_exportcheck.checks.versions import CATALOGUE_VERSION
from pytest_exportcheck.plan._applicability import NotApplicable
from pytest_exportcheck.plan._discovery import Discovery, PluginFailure
from pytest_exportcheck.plan._items import (
    PLUGIN_LOADS,
    ExporterPlan,
    ItemSpec,
    Plan,
    TargetPlan,
    not_applicable,
    plan,
)
from pytest_exportcheck.plan._nodeids import ROOT, SuiteArgs
from pytest_exportcheck.plan._selection import EVERYTHING, PlanRequest, UnknownNames, usage_error
from pytest_exportcheck.plan._xfails import XfailBook, XfailRule, declared_book

if TYPE_CHECKING:
    from pytest_exportcheck.checks import CheckSpec

__all__ = ["Planner"]

_KINDS = ("target", "runtime", "module exporter", "model family", "engine")
#: ``kind -> name -> failures`` of the plugins that failed to load.
_Failed = Mapping[str, Mapping[str, list[PluginFailure]]]


class Planner:
    """Plans items from a discovery record, a request and the suite's node-id arguments.

    Args:
        discovery: what is installed (:func:`~pytest_exportcheck.plan.discover`).
        checks: check id -> spec (the catalogue, ``pytest_exportcheck.checks.CHECKS``).
        unknown: builds the exception an unknown name raises.
        catalogue: the pinned catalogue version (``exportcheck_catalogue``): only
            checks and model families added in it or before (or outside the
            catalogue: ``since=None``) are planned; ``None``: every one.

    Raises:
        pytest.UsageError: ``catalogue`` is not a version from 1 to the current one.
    """

    def __init__(
        self,
        discovery: Discovery,
        checks: Mapping[str, CheckSpec],
        unknown: UnknownNames = usage_error,
        catalogue: int | None = None,
    ) -> None:
        if catalogue is not None and not 1 <= catalogue <= CATALOGUE_VERSION:
            raise pytest.UsageError(
                f"exportcheck_catalogue / --export-catalogue: no catalogue version {catalogue}; "
                f"the versions are 1 to {CATALOGUE_VERSION} (see docs/checks.md)"
            )
        self.catalogue = catalogue
        self._unpinned = (discovery, checks)
        self.discovery = _pinned_discovery(discovery, catalogue)
        self.checks = {
            c: s for c, s in checks.items() if _within(getattr(s, "since", None), catalogue)
        }
        self.unknown = unknown
        self._failed: _Failed = {kind: self._failures(kind) for kind in _KINDS}

    # -- plans --------------------------------------------------------------
    def plan(self, request: PlanRequest) -> Plan:
        """The names of ``request`` resolved against what is installed."""
        d, failed = self.discovery, self._failed
        targets = request.targets.resolve(
            [*d.targets, *failed["target"]],
            what="export target",
            option="--export-targets",
            unknown=self.unknown,
        )
        exporters = request.exporters.resolve(
            [*d.exporters, *failed["module exporter"]],
            what="module exporter",
            option="--export-exporters",
            unknown=self.unknown,
        )
        # Names of a newer catalogue resolve (a pinned run counts them, it does not refuse).
        every_model, every_check = self._unpinned[0].models, self._unpinned[1]
        models = request.models.resolve(
            [*every_model, *failed["model family"]],
            what="model family",
            option="--export-models",
            unknown=self.unknown,
        )
        check_ids = request.checks.resolve(
            [*every_check, PLUGIN_LOADS],
            what="check",
            option="--export-checks",
            unknown=self.unknown,
        )
        return Plan(
            checks=tuple(spec for c, spec in self.checks.items() if c in check_ids),
            targets=tuple(self._target_plan(t) for t in targets),
            exporters=tuple(self._exporter_plan(e) for e in exporters),
            extra_failures=(
                self._extra_failures(targets, models, every_runtime=request.targets.all)
                if PLUGIN_LOADS in check_ids
                else {}
            ),
            models=tuple(m for m in models if m in d.models),
            devices=request.devices,
        )

    def everything(self) -> Plan:
        """The plan of every item that could exist: all names, checks and devices."""
        return self.plan(PlanRequest.everything())

    def items(self, request: PlanRequest, args: SuiteArgs | None = None) -> list[ItemSpec]:
        """The run's items: the request's, or those the suite's node-id arguments name.

        ``exportcheck`` names the request's items; ``exportcheck::<check>`` the
        items of that check over the requested targets, exporters, models and
        devices; an item id names that item whatever the request (like a test
        path on the command line, which pytest collects whatever ``testpaths``
        says). Order is plan order.
        """
        if not args:
            return plan(self.plan(request))
        chosen = {s.name for s in plan(self.plan(request))} if args.whole else set()
        if args.checks:
            unknown = sorted(args.checks - set(self.checks) - {PLUGIN_LOADS})
            if unknown:
                raise pytest.UsageError(self._unknown_check(unknown[0]))
            every_check = PlanRequest(
                request.targets, request.exporters, request.models, EVERYTHING, request.devices
            )
            chosen |= {s.name for s in plan(self.plan(every_check)) if s.check in args.checks}
        universe = plan(self.everything())
        if not args.lenient:
            _require_known(args, {s.name for s in universe}, self._unknown_item)
        chosen |= args.item_ids
        return [s for s in universe if s.name in chosen]

    def pinned_out(self, check: str | None = None, model: str | None = None) -> int | None:
        """The catalogue version that added ``check`` or ``model`` when the pin leaves it out.

        ``None`` when nothing is pinned, the name is planned, or no catalogue has it.
        """
        if self.catalogue is None:
            return None
        discovery, checks = self._unpinned
        if check is not None and check in checks and check not in self.checks:
            return getattr(checks[check], "since", None) or CATALOGUE_VERSION
        if model is not None and model in discovery.models and model not in self.discovery.models:
            return discovery.model_since.get(model) or CATALOGUE_VERSION
        return None

    def pin_message(self, what: str, version: int) -> str:
        """Why a pinned run does not have ``what``, and how to get it."""
        return (
            f"{what} is new in catalogue v{version}, and this run pins v{self.catalogue} "
            f"(exportcheck_catalogue / --export-catalogue / catalogue=): pin {version} or "
            "later to run it"
        )

    def _unknown_check(self, check: str) -> str:
        version = self.pinned_out(check=check)
        if version is not None:
            return self.pin_message(f"{ROOT}::{check}", version)
        return f"{ROOT}::{check}: no such check; available: {', '.join(self.checks)}"

    def not_applicable(self, request: PlanRequest) -> list[NotApplicable]:
        """The (row, check) pairs of ``request`` that cannot apply, with the reason."""
        return not_applicable(self.plan(request))

    def _unknown_item(self, name: str) -> str | None:
        """Why an item id that is no item is none: not applicable, or a newer catalogue's."""
        for spec in plan(replace(self.everything(), keep_inapplicable=True)):
            if spec.name == name and spec.skip:
                return f"{spec.skip} (no item: the cell is not applicable, not skipped)"
        return self._pinned_item(name)

    def _pinned_item(self, name: str) -> str | None:
        """The pin message for an item id that only a newer catalogue plans."""
        if self.catalogue is None:
            return None
        discovery, checks = self._unpinned
        for spec in plan(Planner(discovery, checks, self.unknown).everything()):
            if spec.name == name:
                versions = (self.pinned_out(check=spec.check), self.pinned_out(model=spec.model))
                return self.pin_message(name, max(v for v in versions if v is not None))
        return None

    def newer_items(self, request: PlanRequest) -> dict[int, int]:
        """``{version: count}`` of the request's items a pinned catalogue leaves out.

        An item belongs to the newest version of its check and its model family.
        Empty when nothing is pinned.
        """
        if self.catalogue is None:
            return {}
        discovery, checks = self._unpinned
        planned = {s.name for s in plan(self.plan(request))}
        since = discovery.model_since
        out: dict[int, int] = {}
        for spec in plan(Planner(discovery, checks, self.unknown).plan(request)):
            if spec.name in planned:
                continue
            check = checks.get(spec.check)
            versions = [getattr(check, "since", None), since.get(spec.model or "")]
            version = max((v for v in versions if v is not None), default=CATALOGUE_VERSION)
            out[version] = out.get(version, 0) + 1
        return dict(sorted(out.items()))

    # -- expected failures --------------------------------------------------
    def xfail_book(self, only: Plan | None = None) -> XfailBook:
        """Expected failures declared by targets, exporters and model families.

        ``only``: those of its targets, exporters and models; ``None``: of all installed.

        Raises:
            TypeError: a module exporter declares them as something else than a mapping.
        """
        d = self.discovery
        targets: Iterable[str] = d.targets
        exporters: Iterable[str] = d.exporters
        models: Iterable[str] = d.models
        if only is not None:
            targets = [t.name for t in only.targets if t.loaded]
            exporters = [e.name for e in only.exporters if e.loaded]
            models = only.models
        return declared_book(
            {t: d.targets[t] for t in targets if t in d.targets},
            {e: d.exporters[e] for e in exporters if e in d.exporters},
            {m: d.model_failures.get(m, {}) for m in models},
            {m: d.model_causes.get(m, ()) for m in models},
            checks=set(self.checks),
        )

    def unmatched(self, book: XfailBook, within: Plan | None = None) -> list[XfailRule]:
        """Rules of ``book`` that match no item of ``within`` (default: every possible item)."""
        # A rule of a cell that cannot apply matches it (a family's causes crossed with
        # every target's capture name checks some rows do not have): not stale.
        whole = self.everything() if within is None else within
        universe = plan(replace(whole, keep_inapplicable=True))
        return book.unmatched((s.name, s.check, s.column) for s in universe)

    # -- rows ---------------------------------------------------------------
    def _failures(self, kind: str) -> dict[str, list[PluginFailure]]:
        out: dict[str, list[PluginFailure]] = {}
        for failure in self.discovery.failures:
            if failure.kind == kind:
                out.setdefault(failure.name, []).append(failure)
        return out

    def _extra_failures(
        self, targets: list[str], models: list[str], *, every_runtime: bool
    ) -> dict[str, str]:
        """Failing plugin_loads of selected model families, of runtimes no target uses and
        of every engine plugin that failed to load (``engine:<name>``: its own item, so
        its error is charged to it, not to the other engines' ``served`` items)."""
        d, failed = self.discovery, self._failed
        used = {d.targets[t].runtime for t in targets if t in d.targets}
        extra = {
            f"model:{m}": _failure_text(failed["model family"][m])
            for m in models
            if m in failed["model family"]
        }
        extra |= {f"engine:{e}": _failure_text(fs) for e, fs in failed["engine"].items()}
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
        engines = tuple(self.discovery.target_engines.get(name, ()))
        return TargetPlan(
            name,
            rows,
            info.capabilities,
            failure=_failure_text(problems),
            engines=engines,
            artifact=info.artifact,
        )

    def _exporter_plan(self, name: str) -> ExporterPlan:
        failure = _failure_text(self._failed["module exporter"].get(name, []))
        return ExporterPlan(name, failure, loaded=name in self.discovery.exporters)


def _within(since: int | None, catalogue: int | None) -> bool:
    """Whether something added in catalogue version ``since`` is planned under ``catalogue``."""
    return catalogue is None or since is None or since <= catalogue


def _pinned_discovery(discovery: Discovery, catalogue: int | None) -> Discovery:
    """``discovery`` without the model families added after ``catalogue``."""
    if catalogue is None:
        return discovery
    since = discovery.model_since
    models = tuple(m for m in discovery.models if _within(since.get(m), catalogue))
    return replace(discovery, models=models)


def _require_known(args: SuiteArgs, known: set[str], why: Callable[[str], str | None]) -> None:
    for item, arg in args.items:
        if item in known:
            continue
        reason = why(item)
        if reason is not None:
            raise pytest.UsageError(f"{arg}: {reason}")
        close = difflib.get_close_matches(item, sorted(known), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise pytest.UsageError(
            f"{arg}: no such exportcheck item among every installed target, exporter, "
            f"model family and device{hint}"
        )


def _failure_text(failures: list[PluginFailure]) -> str | None:
    """The messages of ``failures``, one per line; ``None`` when there are none."""
    return "\n".join(f.message for f in failures) or None
