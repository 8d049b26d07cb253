"""pytest plugin entry point (``pytest11: exportcheck``). Wires hooks only; no torch import.

Every hook is a few lines handing off to the :class:`~pytest_exportcheck._session.ExportCheckSession`
kept in ``config.stash``. The session exists only when the suite is active
(``--export-targets`` or ``--export-exporters``, or their ini twins); otherwise
every hook returns at once and the plugin adds no items and imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

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
    "pytest_report_header",
    "pytest_sessionfinish",
    "pytest_terminal_summary",
]

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
    options = Options.from_config(config)
    if not options.active:
        return
    from pytest_exportcheck._session import ExportCheckSession

    session = ExportCheckSession(config, options)
    session.start()
    config.stash[SESSION_KEY] = session
    config.pluginmanager.register(_ReportRecorder(session), "exportcheck-report-recorder")


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    session = _session(config)
    return session.report_header() if session is not None else None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    session = _session(config)
    return session.ignore_collect(collection_path) if session is not None else None


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselection, so they apply to our items
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    state = _session(config)
    if state is not None:
        state.modify_items(session, items)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = _session(config)
    if session is not None:
        session.terminal_summary(terminalreporter)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = _session(session.config)
    if state is not None:
        state.finish()
