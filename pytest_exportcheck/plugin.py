"""pytest plugin entry point (``pytest11: exportcheck``): options, hook specs, markers; no torch.

The suite's hooks are methods of :class:`~pytest_exportcheck.session._session.ExportCheckSession`,
which ``pytest_configure`` creates and registers as a plugin only when the suite
is requested: an ``--export-targets`` / ``--export-exporters`` selection (or their
ini twins), or a node id of the suite on the command line
(``pytest "exportcheck::roundtrip_logits[onnx-llama-cpu]"``), or a bare ``--lf`` after a
run whose suite items failed (those items are planned). Otherwise the plugin
registers its markers, adds no items and imports nothing heavy.
"""

from __future__ import annotations

import pytest

from pytest_exportcheck.plan._nodeids import split_suite_args
from pytest_exportcheck.session.nodes._markers import MARKERS, register_marker
from pytest_exportcheck.session.options._options import Options, add_options

__all__ = ["SESSION_PLUGIN", "pytest_addhooks", "pytest_addoption", "pytest_configure"]

#: Fixtures for plugin authors' own tests (pytest --fixtures); that module imports no torch.
pytest_plugins = ["pytest_exportcheck.fixtures"]

#: The name the active run's session is registered under (``config.pluginmanager.get_plugin``).
SESSION_PLUGIN = "exportcheck-session"


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_exportcheck import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        register_marker(config, name, description)
    options = Options.from_config(config)
    suite_args, other_args = split_suite_args(config.args, config.invocation_params.dir)
    if not (options.active or suite_args):
        from pytest_exportcheck.session.nodes._rerun import last_failed_suite_args

        suite_args = last_failed_suite_args(config)  # a bare --lf after a failed suite run
        if not suite_args:
            return
    from pytest_exportcheck.session.environment._requirements import require_suite_modules

    require_suite_modules()
    if suite_args:  # pytest collects the rest; the suite's node ids are ours
        config.args[:] = other_args
    from pytest_exportcheck.session._session import ExportCheckSession

    config.pluginmanager.register(ExportCheckSession(config, options, suite_args), SESSION_PLUGIN)
