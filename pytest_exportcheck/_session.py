"""The state of one exportcheck run; every hook in ``plugin.py`` hands off to it.

Created in ``pytest_configure`` only when the suite is requested, so everything
here may import exportlm (and through it torch). It ties together the planner
(:mod:`._planner`: which items exist), the nodes (:mod:`._nodes`), the runner
(:mod:`._runner`: running one item) and the reporting (:mod:`._report`,
:mod:`._header`, :mod:`._junit`). Runs in every process: the xdist controller
uses it for the header, the warnings about unmatched expected failures, the
matrix and the reports; workers (and a run without xdist) collect and run the
items.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_exportcheck._collect import ItemSpec
from pytest_exportcheck._discovery import Discovery, discover
from pytest_exportcheck._golden_setup import goldens_dir
from pytest_exportcheck._header import environment, header_lines
from pytest_exportcheck._hypothesis import register_profiles
from pytest_exportcheck._junit import (
    add_suite_properties,
    testcase_properties,
    wants_testcase_properties,
)
from pytest_exportcheck._markers import EXPECTED_WARNINGS, register_marker
from pytest_exportcheck._nodeids import ROOT, SuiteArgs
from pytest_exportcheck._nodes import ExportCheckItem, SuiteCollector
from pytest_exportcheck._options import Options
from pytest_exportcheck._planner import SuitePlanner
from pytest_exportcheck._report import REPORT_ATTRIBUTE, ReportBuilder, write_json_atomic
from pytest_exportcheck._runner import ItemRunner
from pytest_exportcheck._xfails import XfailBook
from pytest_exportcheck.checks import CHECKS

__all__ = ["ExportCheckSession", "Float32Precision"]

logger = logging.getLogger(__name__)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class ExportCheckSession:
    """Planning, collection, running and reporting of one pytest run."""

    def __init__(self, config: pytest.Config, options: Options, args: SuiteArgs) -> None:
        self.config = config
        self.options = options
        self.report = ReportBuilder()
        self.discovery: Discovery = discover()
        planner = SuitePlanner(options, self.discovery, CHECKS)
        self.xfails: XfailBook = planner.xfail_book()
        self.specs: list[ItemSpec] = planner.items(args)
        self.runner = ItemRunner(config, options, self.discovery)
        self.goldens_dir: Path = goldens_dir(config, options)
        #: TF32 off while a run that selects CUDA lasts (restored by :meth:`finish`).
        self.precision = Float32Precision(options.devices)
        self.precision.start()
        register_profiles()
        for name in sorted({m for spec in self.specs for m in spec.markers}):
            register_marker(config, name, "exportcheck items of checks marked so")
        self._testcase_properties = wants_testcase_properties(config)
        if _is_worker(config):
            _share_cpus_between_workers(config)
        else:
            planner.warn_unmatched(config, self.xfails)

    # -- header -------------------------------------------------------------
    def environment(self) -> dict[str, Any]:
        """Options, versions, plugins and plugin failures (header, JSON and JUnit reports)."""
        env = environment(self.options, self.discovery, self.goldens_dir)
        env["environment"]["float32"] = self.precision.describe()
        return env

    def report_header(self) -> list[str]:
        """The lines of the report header (the last one: how float32 matmuls run)."""
        lines = header_lines(self.environment(), self.discovery)
        return [*lines, f"exportcheck float32: {self.precision.describe()}"]

    # -- collection ---------------------------------------------------------
    def ignore_collect(self, path: Path) -> bool | None:
        """With ``--export-only``, nothing of the repo is collected (explicit file args aside)."""
        return True if self.options.only else None

    def add_to_collection(self, session: pytest.Session, report: pytest.CollectReport) -> None:
        """Add the ``exportcheck`` collector to what the session collected."""
        if not report.passed or not self.specs:
            return
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
        spec = item.spec
        item.add_marker(pytest.mark.exportcheck)
        for name in sorted(spec.markers):
            item.add_marker(name)
        for expected in EXPECTED_WARNINGS:
            item.add_marker(pytest.mark.filterwarnings(expected))
        if spec.skip:
            item.add_marker(pytest.mark.skip(reason=spec.skip))
        rules = self.xfails.match(spec.name, spec.check, spec.column)
        if rules:
            reason = "; ".join(f"{r.reason} [{r.source}]" for r in rules)
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))

    def modify_items(self, session: pytest.Session, items: list[pytest.Item]) -> None:
        """Put the suite's items in plan order; with --export-only, deselect every other item."""
        if self.options.only:
            others = [item for item in items if not isinstance(item, ExportCheckItem)]
            if others:
                session.config.hook.pytest_deselected(items=others)
                items[:] = [item for item in items if isinstance(item, ExportCheckItem)]
        order = {spec.name: i for i, spec in enumerate(self.specs)}
        positions = [i for i, item in enumerate(items) if isinstance(item, ExportCheckItem)]
        ours = sorted((items[i] for i in positions), key=lambda it: order[it.name])
        for position, item in zip(positions, ours):
            items[position] = item

    # -- running ------------------------------------------------------------
    def annotate(self, item: pytest.Item, report: pytest.TestReport) -> None:
        """Attach the item's record to its report (and, for JUnit xunit1, its properties)."""
        if not isinstance(item, ExportCheckItem):
            return
        coordinates = item.spec.properties()
        call = report.when == "call"
        result = item.result if call else None
        profile = self.runner.profiles.get(item.nodeid) if call else None
        setattr(
            report, REPORT_ATTRIBUTE, {"item": coordinates, "result": result, "profile": profile}
        )
        if report.when == "teardown" and self._testcase_properties:
            record = {"item": coordinates, "result": item.result}
            report.user_properties = [*report.user_properties, *testcase_properties(record)]

    # -- reporting ----------------------------------------------------------
    def add_report(self, report: pytest.TestReport) -> None:
        """Fold a test report into the matrix (controller / single process only)."""
        if not _is_worker(self.config):
            self.report.add(report)

    def terminal_summary(self, terminal: Any) -> None:
        """Write the matrix section of the terminal summary."""
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
        if self.options.report is not None:
            terminal.write_line(f"JSON report: {self.options.report}")
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
        ran = {(r.check, r.column) for r in records if r.check in golden_ids and r.outcome}
        if not expected <= ran:
            return []
        used = {g for r in records for g in r.details.get("goldens", [])}
        goldens = self.runner.goldens
        return [p for p in goldens.unused(used) if p.exists()]

    def finish(self) -> None:
        """Write the JSON report and the JUnit properties; call ``pytest_exportcheck_report``."""
        self.runner.close()
        self.precision.stop()
        if _is_worker(self.config):
            return
        env = self.environment()
        data = self.report.to_json(**env)
        if self.options.report is not None:
            write_json_atomic(self.options.report, data)
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


# ----------------------------------------------------------------------------- float32 precision


@dataclass(frozen=True)
class _Float32Settings:
    """torch's float32 matmul / cuDNN settings, read and written through one API.

    ``api`` is ``"legacy"`` (``allow_tf32`` and ``set_float32_matmul_precision``) or,
    where torch refuses to read the legacy flags because the new
    ``fp32_precision`` attributes were set, ``"fp32_precision"``.
    """

    api: str
    values: tuple[Any, ...]


#: The new-API attributes (owner path, attribute) saved and restored as they are.
_FP32_PRECISION_ATTRS = (
    ("", "fp32_precision"),
    ("cuda.matmul", "fp32_precision"),
    ("cudnn", "fp32_precision"),
    ("cudnn.conv", "fp32_precision"),
    ("cudnn.rnn", "fp32_precision"),
)


def _backend(path: str) -> Any:
    import torch

    owner: Any = torch.backends
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part)
    return owner


def _read_float32_settings() -> _Float32Settings:
    import torch

    try:
        return _Float32Settings(
            "legacy",
            (
                torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.allow_tf32,
                torch.get_float32_matmul_precision(),
            ),
        )
    except RuntimeError:  # torch refuses legacy reads after the new API was used
        values = tuple(getattr(_backend(o), a) for o, a in _FP32_PRECISION_ATTRS)
        return _Float32Settings("fp32_precision", values)


def _write_float32_settings(settings: _Float32Settings) -> None:
    import torch

    if settings.api == "legacy":
        matmul, cudnn, precision = settings.values
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
        torch.set_float32_matmul_precision(precision)
        return
    for (owner, attr), value in zip(_FP32_PRECISION_ATTRS, settings.values):
        setattr(_backend(owner), attr, value)


#: TF32 off everywhere: float32 matmuls and convolutions in full IEEE float32.
_STRICT = _Float32Settings("legacy", (False, False, "highest"))


class Float32Precision:
    """Turns TF32 off for a run that selects CUDA, and restores the settings afterwards.

    With TF32, CUDA float32 matmuls round their inputs to 10 mantissa bits: logits
    move by about 1e-3 relative, beyond every built-in tolerance, so a roundtrip
    would compare TF32 noise instead of the export. :meth:`start` saves torch's
    settings and sets ``torch.backends.cuda.matmul.allow_tf32 = False``,
    ``torch.backends.cudnn.allow_tf32 = False`` and
    ``torch.set_float32_matmul_precision("highest")``; :meth:`stop` writes back what
    was saved. It applies to the whole pytest process (the repo's own tests in the
    same run included), only when ``cuda`` is among ``devices`` and CUDA is
    available; otherwise nothing is touched.
    """

    def __init__(
        self, devices: tuple[str, ...], cuda_available: Callable[[], bool] | None = None
    ) -> None:
        self.devices = devices
        self._cuda_available = cuda_available
        self._saved: _Float32Settings | None = None
        self.applied = False

    @property
    def wanted(self) -> bool:
        """True when the run selects CUDA and CUDA is available."""
        if "cuda" not in self.devices:
            return False
        if self._cuda_available is not None:
            return self._cuda_available()
        import torch

        return bool(torch.cuda.is_available())

    def start(self) -> None:
        """Save the current settings and turn TF32 off (no-op unless :attr:`wanted`)."""
        if self.applied or not self.wanted:
            return
        self._saved = _read_float32_settings()
        _write_float32_settings(_STRICT)
        self.applied = True
        logger.info("exportcheck: TF32 off for the run (saved %s)", self._saved)

    def stop(self) -> None:
        """Restore the settings :meth:`start` saved (idempotent)."""
        if self._saved is not None:
            _write_float32_settings(self._saved)
        self._saved = None
        self.applied = False

    def describe(self) -> str:
        """One line for the header and the reports."""
        if self.applied:
            return (
                "TF32 off for this run (cuda.matmul.allow_tf32=False, cudnn.allow_tf32=False, "
                "float32_matmul_precision=highest); restored at the end"
            )
        if "cuda" in self.devices:
            return "CUDA not available: float32 settings untouched"
        return "no CUDA device selected: float32 settings untouched"
