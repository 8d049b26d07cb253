"""Configuring the suite: the xfails file, missing dependencies, the plugin kill switch.

Every misconfiguration must be a clean usage error (exit 4) that names what is
wrong, never an INTERNALERROR. Suite runs plan only ``plugin_loads`` /
``registered`` items (no export) and run in-process; the runs that hide a module
or install a fake distribution use a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

import exportlm.export
import exportlm.models
import exportlm.module_exporters  # noqa: F401
import pytest_exportcheck.checks  # noqa: F401
from exportlm.errors import PluginLoadError
from tests._fakeplugin import install

SUITE = ["--export-targets=torch_export,torchscript", "--export-checks=plugin_loads,registered"]

LINES = """\
# expected failures, one node id per line (these items pass, so each strict xfail fails)

exportcheck::plugin_loads::plugin_loads[torchscript:trace]   # the long form, with a reason
exportcheck::registered[torch_export-cpu]
registered[torchscript:*]   # a bare item-id pattern
"""


def test_xfails_file_of_node_ids(pytester: pytest.Pytester) -> None:
    (pytester.path / "xfails.txt").write_text(LINES)
    result = pytester.runpytest(*SUITE, "--export-xfails-file=xfails.txt", "-rf")
    result.assert_outcomes(passed=2, failed=4)  # each listed item passed: strict xfails fail
    text = result.stdout.str()
    assert "[XPASS(strict)] the long form, with a reason [" in text
    assert "xfails.txt:3]" in text
    assert "[XPASS(strict)] listed without a reason [" in text
    assert "[XPASS(strict)] a bare item-id pattern [" in text
    failed = sorted(line.split()[1] for line in result.outlines if line.startswith("FAILED "))
    assert failed == [
        "exportcheck::plugin_loads::plugin_loads[torchscript:trace]",
        "exportcheck::registered::registered[torch_export-cpu]",
        "exportcheck::registered::registered[torchscript:script-cpu]",
        "exportcheck::registered::registered[torchscript:trace-cpu]",
    ]


def test_xfails_file_in_json_still_works(pytester: pytest.Pytester) -> None:
    (pytester.path / "xfails.json").write_text('{"registered[torch_export-*]": "known gap"}\n')
    result = pytester.runpytest(*SUITE, "--export-xfails-file=xfails.json")
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(["*[[]XPASS(strict)] known gap [[]*xfails.json]*"])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"exportcheck::registered\n\xff\xfe not text\n",
            "*xfails.txt, line 2: not UTF-8 text*save the file as UTF-8*",
        ),
        (
            b"exportcheck::registered\ntests/test_x.py::test_y  # not ours\n",
            "*xfails.txt, line 2: 'tests/test_x.py::test_y' is not an exportcheck node id*",
        ),
        (
            b'{"registered": "a reason",\n "dangling"}\n',
            "*xfails.txt, line 2: not valid JSON*",
        ),
        (b"exportcheck::registered[a b]\n", "*xfails.txt, line 1: *is not an exportcheck node*"),
    ],
)
def test_a_bad_xfails_file_is_a_usage_error_naming_file_and_line(
    pytester: pytest.Pytester, content: bytes, message: str
) -> None:
    (pytester.path / "xfails.txt").write_bytes(content)
    result = pytester.runpytest(*SUITE, "--export-xfails-file=xfails.txt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "INTERNALERROR" not in result.stderr.str() + result.stdout.str()


@pytest.mark.parametrize("module", ["torch", "hypothesis"])
def test_a_missing_dependency_is_a_usage_error_naming_it(
    pytester: pytest.Pytester, module: str
) -> None:
    """The suite needs torch and Hypothesis; asking for it without one says what to install."""
    pytester.makeconftest(f"import sys\nsys.modules[{module!r}] = None  # as if not installed\n")
    # Hypothesis' own plugin imports it at startup: leave it out, as when it is not installed
    result = pytester.runpytest_subprocess(
        "--export-targets=torchscript", "-p", "no:hypothesispytest", "-p", "no:cacheprovider"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"*needs the module {module!r}, which cannot be imported*pip install 'exportlm[[]pytest]'*"
        ]
    )
    assert "INTERNALERROR" not in result.stderr.str() + result.stdout.str()
    # not asked for: the plugin stays out of the way
    quiet = pytester.runpytest_subprocess("-p", "no:hypothesispytest", "-p", "no:cacheprovider")
    assert quiet.ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_without_pytest_tmpdir_the_run_uses_a_temporary_directory_of_its_own(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-p no:tmpdir``: the work directories come from ``tempfile``, removed at the end."""
    scratch = pytester.mkdir("scratch")
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the in-process run makes them
    result = pytester.runpytest(
        "--export-targets=torch_export",
        "--export-checks=artifact_contract",
        "--export-no-cache",
        "-p",
        "no:tmpdir",
    )
    result.assert_outcomes(passed=2)  # artifact_contract and the row's plugin_loads
    assert not [p for p in scratch.iterdir() if p.name.startswith("exportcheck-")]


KILL_SWITCH = """
from exportlm.export import EXPORT_REGISTRY, ensure_exporters_registered
from exportlm.models import MODEL_REGISTRY, ensure_models_registered
ensure_exporters_registered()
ensure_models_registered()
print(" ".join(EXPORT_REGISTRY.names()))
print(" ".join(MODEL_REGISTRY.names()))
"""


@pytest.mark.parametrize("disabled", ["1", "0"])
def test_the_kill_switch_disables_third_party_plugins_only(
    pytester: pytest.Pytester, disabled: str
) -> None:
    site = install(pytester.path / "site")
    env = {"PYTHONPATH": str(site), "EXPORTLM_DISABLE_PLUGINS": disabled, "PATH": ""}
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SWITCH],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    targets, models = (line.split() for line in proc.stdout.strip().splitlines()[-2:])
    # exportlm's own entry points (and the in-code onnx) stay
    assert {"onnx", "torchscript", "torch_export", "hf_checkpoint"} <= set(targets)
    assert "decoder" in models
    third_party = {"good", "perturb", "inplace", "swallow"}
    if disabled == "1":
        assert not third_party & set(targets)
        assert "tiny" not in models
    else:
        assert third_party <= set(targets)
        assert "tiny" in models


def test_plugin_load_errors_say_what_the_kill_switch_keeps() -> None:
    error = PluginLoadError("exportlm.export_backends", "x = y:z", "acme 1.0", ImportError("no"))
    assert "EXPORTLM_DISABLE_PLUGINS=1" in str(error)
    assert "without third-party plugins (the built-in targets stay)" in str(error)


@pytest.mark.parametrize(
    ("report", "message"),
    [
        ("notes.txt/report.json", "*cannot write the JSON report to *notes.txt*Not a directory*"),
        ("reports", "*cannot write the JSON report to *reports: it is a directory*"),
    ],
)
def test_an_unwritable_report_path_is_a_usage_error_before_any_work(
    pytester: pytest.Pytester, report: str, message: str
) -> None:
    (pytester.path / "notes.txt").write_text("a file, not a directory\n")
    (pytester.path / "reports").mkdir()
    result = pytester.runpytest(*SUITE, f"--export-report={report}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "INTERNALERROR" not in result.stderr.str() + result.stdout.str()
    assert "passed" not in result.stdout.str()  # nothing ran


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only dirs"
)
def test_a_read_only_report_directory_is_a_usage_error(pytester: pytest.Pytester) -> None:
    locked = pytester.path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        result = pytester.runpytest(*SUITE, "--export-report=locked/report.json")
    finally:
        locked.chmod(0o700)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*locked/report.json: Permission denied*"])


def test_a_report_in_a_directory_still_to_create_is_fine(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(*SUITE, "--export-report=out/new/report.json")
    result.assert_outcomes(passed=6)
    assert json.loads((pytester.path / "out" / "new" / "report.json").read_text())
    assert not [p for p in (pytester.path / "out" / "new").iterdir() if p.name != "report.json"]


def test_every_option_is_in_help_with_its_text_and_its_ini_twin(pytester: pytest.Pytester) -> None:
    """The options are declared once, in the option table, and registered from it in one
    loop: each shows in ``pytest --help`` with its help text, and its ini key with its own."""
    from pytest_exportcheck.session.options._option_specs import _SPECS

    help_text = " ".join(pytester.runpytest("--help").stdout.str().split())
    assert len(_SPECS) >= 25
    for spec in _SPECS:
        shown = spec.flag if spec.metavar is None else f"{spec.flag}={spec.metavar}"
        if spec.kind == "optional":
            shown = f"{spec.flag}=[{spec.metavar}]"
        assert shown in help_text, spec.flag
        assert " ".join(spec.help.split())[:60] in help_text, spec.flag
        ini = spec.ini_key_args()
        if ini is not None:
            assert f"{ini['name']} ({ini['type']}):" in help_text
            assert ini["help"] in help_text


def test_a_bare_optional_flag_and_its_negation_set_the_same_option(
    pytester: pytest.Pytester,
) -> None:
    config = pytester.parseconfig("--export-update-goldens", "--no-export-strict")
    assert config.getoption("export_update_goldens") == "own"
    assert config.getoption("export_strict") == "off"
    assert pytester.parseconfig("--export-strict").getoption("export_strict") == "on"


def test_the_option_table_names_the_values_its_readers_accept() -> None:
    from pytest_exportcheck.session.options._coverage_options import LOCK_MODES
    from pytest_exportcheck.session.options._option_specs import _SPECS
    from pytest_exportcheck.session.options._option_values import UPDATE_SCOPES

    specs = {spec.flag: spec for spec in _SPECS}
    assert specs["--export-lock"].metavar == "|".join(LOCK_MODES)
    assert specs["--export-update-goldens"].metavar == "|".join(UPDATE_SCOPES)
    assert specs["--export-update-goldens"].const == UPDATE_SCOPES[0]
