"""The state of one exportcheck run, registered as a pytest plugin: hooks are its methods.

Created in ``pytest_configure`` (see :mod:`pytest_exportcheck.plugin`) only when the
suite is requested, and registered with ``config.pluginmanager`` the way
pytest-xdist registers its session objects: each hook below is a method, so no
module hook looks the state up. Everything here may import exportlm (and through
it torch). It ties together the plan (:mod:`pytest_exportcheck.plan`: which items
exist), the nodes (:mod:`.nodes._nodes`), the runner (:mod:`._item_runner`, on top of
:func:`pytest_exportcheck.run.run_item`) and the reporting (:mod:`.reporting._report`,
:mod:`.reporting._header`, :mod:`.reporting._junit`). Runs in every process: the xdist controller
uses it for the header, the warnings about unmatched expected failures, the
matrix and the reports; workers (and a run without xdist) collect and run the
items.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from pytest_exportcheck._outcome import expected_failure, item_marks
from pytest_exportcheck._warnings import ExportCheckWarning
from pytest_exportcheck.checks import CHECKS
from pytest_exportcheck.plan import (
    Discovery,
    ItemSpec,
    NameSelection,
    Planner,
    XfailBook,
    discover,
)
from pytest_exportcheck.plan._nodeids import ROOT, SuiteArgs
from pytest_exportcheck.plan._xfails import load_xfails_file
from pytest_exportcheck.run._hypothesis import register_profiles
from pytest_exportcheck.session._item_runner import SuiteRunner
from pytest_exportcheck.session.coverage._coverage import (
    declared_rows,
    planned_value_items,
    value_checks,
)
from pytest_exportcheck.session.coverage._verdict import CoverageVerdict
from pytest_exportcheck.session.environment._float32 import Float32Precision
from pytest_exportcheck.session.environment._golden_setup import goldens_dir
from pytest_exportcheck.session.environment._model_dirs import check_recipes, register_model_dirs
from pytest_exportcheck.session.environment._signing_key import RunSigningKey
from pytest_exportcheck.session.nodes._markers import EXPECTED_WARNINGS, register_marker
from pytest_exportcheck.session.nodes._nodes import ExportCheckItem, SuiteCollector
from pytest_exportcheck.session.nodes._xdist import artifact_scheduler, work_units
from pytest_exportcheck.session.options._options import Options
from pytest_exportcheck.session.reporting._catalogue import catalogue_lines, catalogue_record
from pytest_exportcheck.session.reporting._failure_files import keep_failure
from pytest_exportcheck.session.reporting._header import environment, header_lines
from pytest_exportcheck.session.reporting._junit import (
    add_suite_properties,
    testcase_properties,
    wants_testcase_properties,
)
from pytest_exportcheck.session.reporting._redact import report_paths_redacted
from pytest_exportcheck.session.reporting._report import (
    REPORT_ATTRIBUTE,
    ReportBuilder,
    write_json_atomic,
    write_report_pages,
)

__all__ = ["ExportCheckSession", "Float32Precision"]

logger = logging.getLogger(__name__)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class ExportCheckSession:
    """Planning, collection, running and reporting of one pytest run."""

    def __init__(self, config: pytest.Config, options: Options, args: SuiteArgs) -> None:
        self.config = config
        self.options = options
        register_model_dirs(options.model_dirs)  # the user's own models: families too
        check_recipes(options.quantize)
        self.discovery: Discovery = discover()
        planner = Planner(self.discovery, CHECKS, catalogue=options.catalogue)
        self.xfails: XfailBook = _xfail_book(planner, options)
        self.specs: list[ItemSpec] = planner.items(options.request(), args)
        self.catalogue = catalogue_record(planner, options.request())
        #: This user's signing key, or the run's own when it is unusable (:mod:`.environment._signing_key`).
        self.signing = RunSigningKey(config)
        config.pluginmanager.register(self.signing, "exportcheck-signing-key")
        self.runner = SuiteRunner(
            config, options, self.discovery, cross_run=not self.signing.temporary
        )
        self.goldens_dir: Path = goldens_dir(config, options)
        #: TF32 off while a run that selects CUDA lasts (restored by :meth:`finish`).
        self.precision = Float32Precision(options.devices)
        self.precision.start()
        register_profiles()
        for name in sorted({m for spec in self.specs for m in spec.markers}):
            register_marker(config, name, "exportcheck items of checks marked so")
        self._testcase_properties = wants_testcase_properties(config)
        # every check's value-check items per row, whatever narrowed this run (-k, -m,
        # --export-checks, node ids, --lf): a row missing some of them was narrowed
        every = planner.items(options.request(NameSelection(all=True)))
        value = value_checks(CHECKS.values())  # each check says whether it is one
        planned, declared = planned_value_items(every, value), declared_rows(self.discovery)
        # the (row, check) cells of the request that cannot apply: no items, listed with why
        inapplicable = [c.as_json() for c in planner.not_applicable(options.request())]
        #: strict, lockfile and shard: the coverage part of the verdict (:mod:`.coverage._verdict`).
        self.coverage = CoverageVerdict(
            config.rootpath, options, self.specs, planned, declared, inapplicable, value
        )
        self.report = ReportBuilder(
            planned, declared, self.coverage.judged_rows(), inapplicable, value
        )
        if not _is_worker(config):
            self.coverage.load()  # a bad lockfile is a usage error before anything runs
        if _is_worker(config):
            _share_cpus_between_workers(config)
        else:
            _warn_unmatched(config, planner, self.xfails)

    # -- header -------------------------------------------------------------
    def environment(self) -> dict[str, Any]:
        """Options, versions, plugins and plugin failures (header, JSON and JUnit reports)."""
        env = environment(self.options, self.discovery, self.goldens_dir)
        env["environment"]["float32"] = self.precision.describe()
        env["catalogue"] = self.catalogue
        return env

    def pytest_report_header(self) -> list[str]:
        """The lines of the report header (the last one: how float32 matmuls run)."""
        lines = header_lines(self.environment(), self.discovery)
        pinned = " (pinned)" if self.catalogue["pinned"] else ""
        return [
            *lines,
            f"exportcheck catalogue: v{self.catalogue['version']}{pinned}, current "
            f"v{self.catalogue['current']}",
            f"exportcheck float32: {self.precision.describe()}",
        ]

    # -- collection ---------------------------------------------------------
    def pytest_ignore_collect(self, collection_path: Path) -> bool | None:
        """With ``--export-only``, nothing of the repo is collected (explicit file args aside)."""
        return True if self.options.only else None

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        """Add the ``exportcheck`` collector to what the session collected."""
        report = yield
        if isinstance(collector, pytest.Session) and report.passed and self.specs:
            self._add_suite(collector, report)
        return report

    def _add_suite(self, session: pytest.Session, report: pytest.CollectReport) -> None:
        root = SuiteCollector.from_parent(
            session,
            name=ROOT,
            nodeid=ROOT,
            specs=self.specs,
            runner=self.runner,
            decorate=self.decorate,
        )
        report.result = [*report.result, root]

    def decorate(self, item: ExportCheckItem) -> None:
        """Mark an item: ``exportcheck``, its check's markers, warning filters, skip, xfail."""
        for mark in item_marks(item.spec, expected_failure(item.spec, self.xfails)):
            item.add_marker(mark)  # as parametrize_with_checks marks its parameters
        for expected in EXPECTED_WARNINGS:
            item.add_marker(pytest.mark.filterwarnings(expected))

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        """Under ``--dist load``: the items that share an artifact (or the survey) go to one
        worker together (:mod:`.nodes._xdist`); ``None`` lets xdist choose."""
        return artifact_scheduler(config, log, work_units(self.specs))

    @pytest.hookimpl(tryfirst=True)  # before -k / -m / --lf / --sw, so they apply to our items
    def pytest_collection_modifyitems(
        self, session: pytest.Session, items: list[pytest.Item]
    ) -> None:
        """Put the suite's items in plan order; with --export-only, deselect every other item."""
        if self.options.only:
            others = [item for item in items if not isinstance(item, ExportCheckItem)]
            if others:
                session.config.hook.pytest_deselected(items=others)
                items[:] = [item for item in items if isinstance(item, ExportCheckItem)]
        self.coverage.deselect_other_shards(session, items)
        order = {spec.name: i for i, spec in enumerate(self.specs)}
        positions = [i for i, item in enumerate(items) if isinstance(item, ExportCheckItem)]
        ours = sorted((items[i] for i in positions), key=lambda it: order[it.name])
        for position, item in zip(positions, ours):
            items[position] = item

    # -- running ------------------------------------------------------------
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """Attach the item's record to its report (and, for JUnit xunit1, its properties)."""
        report = yield
        if isinstance(item, ExportCheckItem):
            self._annotate(item, report)
        return report

    def _annotate(self, item: ExportCheckItem, report: pytest.TestReport) -> None:
        coordinates = item.spec.properties()
        call = report.when == "call"
        result = item.result if call else None
        profile = self.runner.profiles.get(item.nodeid) if call else None
        setattr(
            report, REPORT_ATTRIBUTE, {"item": coordinates, "result": result, "profile": profile}
        )
        if call and report.failed and result is not None:
            kept = keep_failure(self.config.rootpath, item.spec.name, result)
            if kept:
                report.sections.append(("exportcheck: shrunk failure", "\n".join(kept)))
        if report.when == "teardown" and self._testcase_properties:
            record = {"item": coordinates, "result": item.result}
            report.user_properties = [*report.user_properties, *testcase_properties(record)]

    # -- reporting ----------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Fold a test report into the matrix (controller / single process only)."""
        if not _is_worker(self.config):
            self.report.add(report)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Write the matrix section of the terminal summary."""
        terminal = terminalreporter
        if _is_worker(self.config) or self.config.option.collectonly:
            return
        terminal.write_sep("=", "exportcheck conformance matrix")
        width = self.config.get_terminal_writer().fullwidth
        for line in self.report.summary_lines(width):
            terminal.write_line(line)
        if self.options.durations:
            terminal.write_sep("=", f"exportcheck: slowest {self.options.durations} items")
            for line in self.report.durations_lines(self.options.durations):
                terminal.write_line(line)
        for line in catalogue_lines(self.catalogue):
            terminal.write_line(line, yellow=True)
        for kind, path in (
            ("JSON report", self.options.report),
            ("HTML report", self.options.report_html),
            ("badge", self.options.report_badge),
        ):
            if path is not None:
                terminal.write_line(f"{kind}: {path}")
        self.coverage.summary(terminal)
        key_line = self.signing.summary_line()
        if key_line is not None:
            terminal.write_line(key_line, yellow=True)
        unused = self.unused_goldens()
        if unused:
            terminal.write_line(
                f"exportcheck: {len(unused)} golden file(s) under {self.goldens_dir} were used "
                "by no item of this full run (stale? delete them, or check the case list):",
                yellow=True,
            )
            for path in unused:
                terminal.write_line(f"  {path}")

    def unused_goldens(self) -> list[Path]:
        """Golden files no item compared or wrote, after a run of every golden item.

        Empty unless every golden item ran (every exporter and every golden
        check planned and run, nothing deselected), so a partial run never calls
        a golden unused.
        """
        if not self.options.exporter_selection.all:
            return []
        golden_ids = {c for c in CHECKS if c.startswith("golden_")}
        exporters = {s.column for s in self.specs if s.scope == "exporter"}
        expected = {(c, e) for c in golden_ids for e in exporters}
        if not expected or not expected <= {(s.check, s.column) for s in self.specs}:
            return []
        records = list(self.report.records.values())
        ran = {
            (r.check, r.column)
            for r in records
            if r.check in golden_ids and r.outcome != "incomplete"
        }
        if not expected <= ran:
            return []
        used = {g for r in records for g in r.details.get("goldens", [])}
        goldens = self.runner.goldens
        return [p for p in goldens.unused(used) if p.exists()]

    @pytest.hookimpl(tryfirst=True)  # before the JUnit XML writer writes its file
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Judge coverage, write the JSON report and the JUnit properties, call the report hook."""
        self.runner.close()
        self.precision.stop()
        self.signing.close()
        if _is_worker(self.config):
            return
        self.report.interrupted = session.exitstatus == pytest.ExitCode.INTERRUPTED
        # a lockfile check that cannot apply now may leave a narrowed run no item at all
        quiet = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.coverage.judge(self.report.sorted_records()) and session.exitstatus in quiet:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        env = self.environment()
        data = self.report.to_json(**env)
        if not self.options.report_absolute_paths:  # the report is a CI artifact: no local paths
            data = report_paths_redacted(data, self.config)
            env = {key: data[key] for key in env}
        if self.options.report is not None:
            write_json_atomic(self.options.report, data)
        write_report_pages(data, self.options.report_html, self.options.report_badge)
        add_suite_properties(self.config, env, self.report.sorted_records())
        self.config.hook.pytest_exportcheck_report(config=self.config, report=data)


#: Environment variables with which a user fixes the thread count; they win over the share.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _share_cpus_between_workers(config: pytest.Config) -> None:
    """Give each xdist worker its share of the CPUs for torch's intra-op thread pool.

    torch sizes its pool to every core of the machine in every process, so with
    ``-n auto`` N workers run N x cores spinning OpenMP threads on the cores:
    measured on 2 cores, quantizing and exporting the toy models got 10-20x slower
    than with one thread per worker. A thread count the user fixed through
    ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` is kept.
    """
    if any(os.environ.get(name) for name in _THREAD_ENV):
        return
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1) or 1)
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    share = max(1, cpus // workers)
    import torch

    if share < torch.get_num_threads():
        logger.info(
            "exportcheck worker: torch threads %d -> %d (%d workers)",
            torch.get_num_threads(),
            share,
            workers,
        )
        torch.set_num_threads(share)


def _xfail_book(planner: Planner, options: Options) -> XfailBook:
    """Expected failures declared by targets, exporters, model families and the xfails file."""
    try:
        book = planner.xfail_book()
    except TypeError as err:
        raise pytest.UsageError(str(err)) from err
    if options.xfails_file is not None:
        book.extend(load_xfails_file(options.xfails_file))
    return book


def _warn_unmatched(config: pytest.Config, planner: Planner, book: XfailBook) -> None:
    """Warn (a usage error under ``-W error``) about rules that match no possible item."""
    for rule in planner.unmatched(book):
        warning = ExportCheckWarning(
            f"expected failure {rule.pattern!r} ({rule.source}) matches no exportcheck "
            "item; fix the check id or item id pattern, or remove the entry"
        )
        try:
            config.issue_config_time_warning(warning, stacklevel=2)
        except ExportCheckWarning as err:  # -W error::...ExportCheckWarning
            raise pytest.UsageError(str(err)) from err
