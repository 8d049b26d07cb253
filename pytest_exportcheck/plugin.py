"""pytest plugin entry point (``pytest11: exportcheck``). Wires hooks only; no torch import.

Every hook is a few lines handing off to the :class:`~pytest_exportcheck._session.ExportCheckSession`
kept in ``config.stash``. The session exists only when the suite is requested: an
``--export-targets`` / ``--export-exporters`` selection (or their ini twins), or a
node id of the suite on the command line (``pytest "exportcheck::roundtrip_logits[onnx-llama-cpu]"``).
Otherwise every hook returns at once: the plugin registers its markers, adds no
items and imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_exportcheck._markers import MARKERS, register_marker
from pytest_exportcheck._nodeids import split_suite_args
from pytest_exportcheck._options import Options, add_options

if TYPE_CHECKING:
    from pytest_exportcheck._session import ExportCheckSession

__all__ = [
    "SESSION_KEY",
    "pytest_addhooks",
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_ignore_collect",
    "pytest_make_collect_report",
    "pytest_report_header",
    "pytest_runtest_makereport",
    "pytest_sessionfinish",
    "pytest_terminal_summary",
]

#: Fixtures for plugin authors' own tests (pytest --fixtures); that module imports no torch.
pytest_plugins = ["pytest_exportcheck.fixtures"]

#: Where the active run's session object lives.
SESSION_KEY = pytest.StashKey["ExportCheckSession"]()


def _session(config: pytest.Config) -> ExportCheckSession | None:
    return config.stash.get(SESSION_KEY, None)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_exportcheck import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


class _ReportRecorder:
    """Receives ``pytest_runtest_logreport`` (whose signature has no config) for the session."""

    def __init__(self, session: ExportCheckSession) -> None:
        self.session = session

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.session.add_report(report)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        register_marker(config, name, description)
    options = Options.from_config(config)
    suite_args, other_args = split_suite_args(config.args, config.invocation_params.dir)
    if not (options.active or suite_args):
        return
    from pytest_exportcheck._requirements import require_suite_modules

    require_suite_modules()
    if suite_args:  # pytest collects the rest; the suite's node ids are ours
        config.args[:] = other_args
    from pytest_exportcheck._session import ExportCheckSession

    session = ExportCheckSession(config, options, suite_args)
    config.stash[SESSION_KEY] = session
    config.pluginmanager.register(_ReportRecorder(session), "exportcheck-report-recorder")


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    session = _session(config)
    return session.report_header() if session is not None else None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    session = _session(config)
    return session.ignore_collect(collection_path) if session is not None else None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    state = _session(collector.config)
    if state is not None and isinstance(collector, pytest.Session):
        state.add_to_collection(collector, report)
    return report


@pytest.hookimpl(tryfirst=True)  # before -k / -m / --lf / --sw, so they apply to our items
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    state = _session(config)
    if state is not None:
        state.modify_items(session, items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    state = _session(item.config)
    if state is not None:
        state.annotate(item, report)
    return report


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = _session(config)
    if session is not None:
        session.terminal_summary(terminalreporter)


@pytest.hookimpl(tryfirst=True)  # before the JUnit XML writer writes its file
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = _session(session.config)
    if state is not None:
        state.finish()
