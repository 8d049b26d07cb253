"""The plugin's verdict reads true: a cancelled run is not green, a built-in row a target
declares it cannot check does not fail strict, ``-k`` narrows without failing, and the
JSON report names no local path (issues 39 and 42).

Runs are in this process (:func:`tests._installed.runpytest_installed`) and small: one
family, a few checks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from exportlm.cli import main
from tests._distinfo import make_distribution
from tests._installed import installed, runpytest_installed
from tests.test_plugin_coverage import ENTRY_POINTS, PLUGIN


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_cuda: None) -> Path:
    root = tmp_path / "site"
    make_distribution(root, "covplugin", ENTRY_POINTS, {"covplugin.py": PLUGIN})
    monkeypatch.delenv("CI", raising=False)
    return root


def _report(pytester: pytest.Pytester, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((pytester.path / name).read_text())
    return data


def test_a_run_cancelled_mid_item_reports_it_unfinished_and_the_merge_fails(
    pytester: pytest.Pytester,
    site: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("COVPLUGIN_SIGINT", "1")
    suite = [
        "--export-targets=saver",
        "--export-models=decoder",
        "--export-checks=roundtrip_logits",
    ]
    with installed(site):
        result = pytester.runpytest(*suite, "--export-report=r.json", no_reraise_ctrlc=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    report = _report(pytester, "r.json")
    assert report["interrupted"] is True
    (item,) = [i for i in report["items"] if i["check"] == "roundtrip_logits"]
    assert item["outcome"] == "incomplete"  # was "", counted as passed
    assert report["totals"]["fail"] == 1  # plugin_loads passed; the cancelled item did not
    assert report["matrix"]["target"]["saver"]["roundtrip_logits"]["fail"] == 1
    capsys.readouterr()
    assert main(["report", "merge", str(pytester.path / "r.json"), "--strict"]) == 1
    out = capsys.readouterr().out
    assert "the run was interrupted" in out
    assert f"1 unfinished item(s): {item['nodeid']}" in out


def test_the_json_report_names_no_home_user_or_rootdir(
    pytester: pytest.Pytester, site: Path
) -> None:
    report_path = pytester.path / "out" / "r.json"
    report_path.parent.mkdir()
    result = runpytest_installed(
        pytester,
        site,
        "--export-targets=saver",
        "--export-models=decoder",
        "--export-checks=registered",
        f"--export-report={report_path}",
    )
    assert result.ret == 0
    text = report_path.read_text()
    assert str(pytester.path) not in text
    assert os.path.expanduser("~") not in text
    assert f"pytest-of-{os.environ.get('USER') or 'root'}" not in text
    assert json.loads(text)["options"]["report"] == "out/r.json"
    kept = runpytest_installed(
        pytester,
        site,
        "--export-targets=saver",
        "--export-models=decoder",
        "--export-checks=registered",
        f"--export-report={report_path}",
        "--export-report-absolute-paths",
    )
    assert kept.ret == 0
    assert json.loads(report_path.read_text())["options"]["report"] == str(report_path)


FRESH = ["--export-targets=torchscript", "--export-models=decoder", "-p", "no:randomly"]


def test_a_fresh_ci_run_of_a_built_in_target_passes_strict_with_its_declared_row(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, no_cuda: None
) -> None:
    # What a plugin author's CI runs: no ini, no export_strict_allow; strict is on under CI.
    monkeypatch.setenv("CI", "true")
    checks = "--export-checks=registered,roundtrip_logits,trust"
    result = pytester.runpytest(*FRESH, checks, "--export-report=r.json")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "declared unchecked target torchscript:script (its declaration, not a failure): "
            "no toy family scripts under TorchScript*"
        ]
    )
    assert "FAILED" not in result.stdout.str()
    report = _report(pytester, "r.json")
    assert report["unchecked"] == {}
    assert list(report["declared_unchecked"]["target"]) == ["torchscript:script"]


LONELY = ["--export-exporters=lonely", "--export-models=decoder"]


@pytest.mark.parametrize(
    "narrowing",
    [
        ["-k", "precedence or export_contract"],
        ["--export-checks=precedence,export_contract,tied_weights"],
    ],
    ids=["k", "export-checks"],
)
def test_narrowing_a_row_to_skips_is_not_selected_not_a_strict_failure(
    pytester: pytest.Pytester, site: Path, monkeypatch: pytest.MonkeyPatch, narrowing: list[str]
) -> None:
    # lonely claims no module of the toy models: every value check of it that runs
    # skips; narrowed, the others (which fail on it) did not run
    monkeypatch.setenv("CI", "true")
    result = runpytest_installed(pytester, site, *LONELY, *narrowing, "--export-report=r.json")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "not selected exporter(s), no value check of theirs selected (-k, -m, "
            "--export-checks; not judged): lonely",
            "exportcheck: 1 row(s) had no value check selected (-k, -m, --export-checks), not "
            "judged by --export-strict: exporter lonely",
        ]
    )
    report = _report(pytester, "r.json")
    assert report["unchecked"] == {}
    assert report["not_selected"] == {"exporter": ["lonely"]}
    assert "golden_checkpoint[lonely]" in report["planned"]["exporter"]["lonely"]


def test_the_lockfile_still_catches_lost_coverage_in_a_narrowed_run(
    pytester: pytest.Pytester, site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite = ["--export-targets=saver", "--export-models=decoder,llama"]
    monkeypatch.setenv("COVPLUGIN_DYNAMIC", "1")
    written = runpytest_installed(
        pytester, site, *suite, "--export-checks=dynamic_shapes", "--export-lock=update"
    )
    assert written.ret == 0
    monkeypatch.setenv("COVPLUGIN_DYNAMIC", "0")
    monkeypatch.setenv("CI", "true")
    lost = runpytest_installed(pytester, site, *suite, "-k", "dynamic_shapes")
    assert lost.ret == pytest.ExitCode.TESTS_FAILED
    text = lost.stdout.str()
    assert "--export-strict: FAILED" not in text  # the row is narrowed: strict does not judge it
    # without the capability the check cannot apply: no item is left for -k to select
    lost.stdout.fnmatch_lines(
        [
            "*exportcheck.lock: FAILED, 1 change(s) lose coverage*",
            "  check dynamic_shapes disappeared from target saver (2 item(s) in the lockfile, "
            "not applicable now: target 'saver' does not declare 'dynamic_shapes' "
            "(declared: none))",
        ]
    )


def test_a_target_declares_only_its_own_rows_unchecked_and_gives_a_reason() -> None:
    from exportlm.export import export_target
    from exportlm.export.torchscript import TORCHSCRIPT_TARGET

    assert set(TORCHSCRIPT_TARGET.unchecked) == {"script"}  # trace is checked on every family
    with pytest.raises(ValueError, match=r"unchecked names rows it does not have: \['nope'\]"):
        export_target("y", unchecked={"nope": "why"})
    with pytest.raises(ValueError, match=r"unchecked rows \['a'\] give no reason"):
        export_target("y", variants={"a": {}}, unchecked={"a": " "})
