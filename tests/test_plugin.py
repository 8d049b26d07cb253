"""The exportcheck pytest plugin, driven end to end through ``pytester``.

Runs with a fake third-party plugin discovered through a real ``*.dist-info`` run in
this process with the registries as a fresh process would load them
(:func:`tests._installed.runpytest_installed`); the ones that check what a fresh
process imports start one. Each run checks many things at once. Demo checks
registered by the generated ``conftest.py`` exercise the plugin machinery
independently of the real check catalogue.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

# In-process pytester runs drop the modules they imported when they end; import
# what the suite loads once here, so those runs reuse it (and its registries).
import exportlm.export
import exportlm.models
import exportlm.module_exporters  # noqa: F401
import pytest_exportcheck.checks  # noqa: F401
from tests._distinfo import make_distribution
from tests._fakeplugin import DIST, install
from tests._installed import runpytest_installed

DEMO_CHECKS = '''
import hypothesis

from pytest_exportcheck.checks._api import CheckResult, check


@check("demo_pass", scope="target", per_model=True)
def demo_pass(case):
    """Exports through the cached case.export and passes (fake targets only: fast)."""
    if case.target != "good":
        return CheckResult.skipped("demo_pass exports only the fake 'good' target")
    path = case.export(case.model_name)
    return CheckResult.passed("exported", artifact=path.name, read_only=not path.stat().st_mode & 0o222)


@check("demo_fail", scope="target")
def demo_fail(case):
    """Always fails with numbers."""
    return CheckResult.failed("logits differ beyond tolerance", max_abs=0.5, mismatch_pct=12.5)


@check("demo_xpass", scope="target")
def demo_xpass(case):
    """Always passes (declared as an expected failure by the fake plugin)."""
    return CheckResult.passed()


@check("demo_kv", scope="target", needs=("kv_cache",))
def demo_kv(case):
    """Needs a capability no fake target declares."""
    return CheckResult.passed()


@check("demo_settings", scope="target")
def demo_settings(case):
    """Reports the Hypothesis settings it runs under and the device."""
    current = hypothesis.settings()
    return CheckResult.passed(
        deadline=str(current.deadline), max_examples=current.max_examples, device=case.device
    )
'''

CONFTEST = (
    DEMO_CHECKS + 'hypothesis.settings.register_profile("mine", deadline=1234, max_examples=3)\n'
)


def _env(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the fake plugin's export log into the run's directory; returns the log."""
    counter = pytester.path / "exports.log"
    monkeypatch.setenv("FAKEPLUGIN_COUNTER", str(counter))
    return counter


def _exports(counter: Path) -> list[str]:
    return counter.read_text().split() if counter.exists() else []


def _items(report: Path) -> dict[str, dict[str, Any]]:
    data = json.loads(report.read_text())
    return {item["id"]: item for item in data["items"]}


def _without_durations(report: Path) -> dict[str, Any]:
    """The report less what differs between two runs of the same items: times, the
    report path, and where each item's artifact came from (exported, or the cache)."""
    data = json.loads(report.read_text())
    for item in data["items"]:
        item.pop("duration")
        item.pop("profile", None)
    data.pop("options")  # the report path differs between the runs
    data.pop("cache", None)
    return data


def test_passive_without_an_export_option(pytester: pytest.Pytester) -> None:
    """Installed but not asked: no items, no torch import, options in --help."""
    pytester.makeconftest(
        "import sys\n"
        "def pytest_sessionfinish(session):\n"
        "    heavy = [m for m in ('torch', 'exportlm') if m in sys.modules]\n"
        "    open('imported.txt', 'w').write(repr(heavy))\n"
    )
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    assert (pytester.path / "imported.txt").read_text() == "[]"
    assert "exportcheck" not in result.stdout.str()

    help_text = pytester.runpytest("--help").stdout.str()
    assert "exportcheck: export conformance suite" in help_text
    for option in (
        "--export-targets",
        "--export-exporters",
        "--export-models",
        "--export-device",
        "--export-require-device",
        "--export-xfails-file",
        "--export-update-goldens",
        "--export-goldens-dir",
        "--export-report",
        "--export-no-cache",
        "--export-only",
        "export_targets (string)",
    ):
        assert option in help_text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--export-targets=onnx,nope"], "unknown export target 'nope'; available: "),
        (["--export-targets=onnx", "--export-models=nope"], "unknown model family 'nope'"),
        (["--export-targets=onnx", "--export-device=tpu"], "unknown device 'tpu'"),
        (["--export-targets=onnx", "--export-checks=nope"], "unknown check 'nope'"),
        (["--export-only"], "--export-only needs --export-targets"),
        (["--export-targets=onnx", "--export-xfails-file=missing.json"], "does not exist"),
        (["--export-targets=onnx", "--export-xfails-file=list.json"], "must hold one JSON object"),
        (
            [
                "--export-targets=onnx",
                "--export-xfails-file=typo.json",
                "-W",
                "error::pytest_exportcheck.ExportCheckWarning",
            ],
            "expected failure 'roundtrip_logit' (*typo.json) matches no exportcheck item",
        ),
    ],
)
def test_bad_option_is_a_usage_error(
    pytester: pytest.Pytester, args: list[str], message: str
) -> None:
    (pytester.path / "list.json").write_text('["roundtrip_logits"]')
    (pytester.path / "typo.json").write_text('{"roundtrip_logit": "misspelled check id"}')
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


@pytest.mark.usefixtures("no_cuda")  # the cuda items must skip (or fail), on any machine
def test_fake_third_party_plugin(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin installed through a real dist-info is discovered, checked and reported.

    The same suite runs twice in one directory: without xdist, then with ``-n 2``,
    which reuses the first run's cached artifacts and writes the same JSON report.
    """
    site = install(pytester.path / "site")
    counter = _env(pytester, monkeypatch)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_own="def test_own_test():\n    pass\n")
    (pytester.path / "xfails.json").write_text(
        json.dumps(
            {
                "demo_settings[good-cuda]": "file entry: no CUDA here",
                "demo_pass[nothing-*]": "matches nothing: must warn",
            }
        )
    )
    common = [
        "--export-targets=good,broken,onnx",
        "--export-models=tiny",
        "--export-device=cpu,cuda",
        "--export-checks=plugin_loads,demo_pass,demo_fail,demo_xpass,demo_kv,demo_settings",
        "--export-xfails-file=xfails.json",
        "-rA",
    ]

    first = runpytest_installed(pytester, site, *common, "--export-report=serial.json", "-n", "0")
    out = first.stdout.str()
    assert first.ret == pytest.ExitCode.TESTS_FAILED
    # header: options, versions, every plugin with its distribution, failures
    first.stdout.fnmatch_lines(
        [
            "exportcheck: targets=broken,good,onnx *models=tiny * device=cpu,cuda *",
            "exportcheck versions: python *, exportlm *, torch *, transformers *, onnx *, "
            "onnxruntime *; CUDA not available",
            f"exportcheck targets: *{DIST}: good, inplace, perturb, swallow*",
            f"exportcheck model families: *{DIST}: tiny*",
            f"exportcheck target 'broken' from {DIST} FAILED to load*",
            f"exportcheck target 'onnx' from {DIST} claims a taken name*",
        ]
    )
    # the repo's own test runs alongside; the matrix is printed
    assert "PASSED test_own.py::test_own_test" in out
    first.stdout.fnmatch_lines(
        [
            "*= exportcheck conformance matrix =*",
            r"check \ target * broken * good * onnx",
            "plugin_loads * 0/1 F1 * 1/1 * 0/1 F1",
            "demo_pass * - * 1/2 s1 * 0/2 s2",
            "demo_fail * - * 0/2 x1 s1 * 0/2 F1 s1",
            "demo_kv * - * · * 1/2 s1",  # ·: 'good' declares no kv_cache, the cell cannot apply
            "*items: * passed, * failed, * xfailed, * skipped *",
        ]
    )
    first.stdout.fnmatch_lines(
        [
            "*ExportCheckWarning: expected failure 'no_such_check' (TargetInfo of 'good') matches no*",
            "*ExportCheckWarning: expected failure 'demo_pass[[]nothing-*]' * matches no*",
        ]
    )

    items = _items(pytester.path / "serial.json")
    broken = items["plugin_loads[broken]"]
    assert broken["outcome"] == "fail"
    assert DIST in broken["message"]
    assert "ImportError: fakeplugin_broken needs libfoo" in broken["message"]
    assert items["plugin_loads[onnx]"]["outcome"] == "fail"
    assert (
        "'onnx' is already registered by exportlm (built in)"
        in items["plugin_loads[onnx]"]["message"]
    )
    assert items["plugin_loads[good]"]["outcome"] == "pass"
    assert "demo_pass[broken-tiny-cpu]" not in items  # a target that failed to load gets no checks
    # pass, with a read-only cached artifact; cuda skips without CUDA
    assert items["demo_pass[good-tiny-cpu]"]["details"] == {
        "artifact": "model.pt",
        "read_only": True,
    }
    assert items["demo_pass[good-tiny-cuda]"]["outcome"] == "skip"
    assert "CUDA is not available" in items["demo_pass[good-tiny-cuda]"]["message"]
    # failure text and numbers; expected failures from TargetInfo are strict
    assert items["demo_fail[onnx-cpu]"]["outcome"] == "fail"
    assert items["demo_fail[onnx-cpu]"]["details"] == {"max_abs": 0.5, "mismatch_pct": 12.5}
    assert "logits differ beyond tolerance\n  max_abs: 0.5" in out
    assert items["demo_fail[good-cpu]"]["outcome"] == "xfail"
    assert items["demo_xpass[good-cpu]"]["outcome"] == "fail"
    assert (
        "[XPASS(strict)] declared but the check passes" in items["demo_xpass[good-cpu]"]["message"]
    )
    assert items["demo_xpass[onnx-cpu]"]["outcome"] == "pass"
    # a capability the target does not declare: no item, a cell listed once with the reason
    assert "demo_kv[good-cpu]" not in items
    cells = json.loads((pytester.path / "serial.json").read_text())["not_applicable"]
    (gap,) = [c for c in cells if (c["column"], c["check"]) == ("good", "demo_kv")]
    assert "target 'good' does not declare 'kv_cache'" in gap["reason"]
    assert gap["items"] == 2  # its cpu and cuda items
    assert items["demo_kv[onnx-cpu]"]["outcome"] == "pass"
    assert items["demo_settings[good-cuda]"]["outcome"] == "skip"  # skip wins over the file's xfail
    # the exportcheck Hypothesis profile applies while no profile was chosen
    assert items["demo_settings[good-cpu]"]["details"]["deadline"] == "None"
    assert _exports(counter) == ["good"]  # one export, shared by every check that needs it

    second = runpytest_installed(
        pytester, site, *common, "--export-report=parallel.json", "-n", "2"
    )
    assert second.ret == pytest.ExitCode.TESTS_FAILED
    assert _without_durations(pytester.path / "parallel.json") == _without_durations(
        pytester.path / "serial.json"
    )
    assert _exports(counter) == ["good"]  # the cross-run cache served both workers
    cache_use = json.loads((pytester.path / "parallel.json").read_text())["cache"]
    assert cache_use["exports"] == 0, cache_use  # and the report says so
    assert cache_use["served_from_cache"] > 0, cache_use


@pytest.mark.usefixtures("no_cuda")  # the cuda items must skip (or fail), on any machine
def test_export_only_no_cache_require_device_and_user_profile(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--export-only hides the repo's tests; --export-no-cache keeps nothing across runs;
    --export-require-device fails what would skip; the user's Hypothesis profile wins."""
    site = install(pytester.path / "site")
    counter = _env(pytester, monkeypatch)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_own="def test_own_test():\n    pass\n")
    result = runpytest_installed(
        pytester,
        site,
        "--export-targets=good",
        "--export-models=tiny",
        "--export-device=cpu,cuda",
        "--export-checks=demo_pass,demo_settings",
        "--export-no-cache",
        "--export-only",
        "--export-require-device",
        "--hypothesis-profile=mine",
        "--export-report=report.json",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "test_own_test" not in result.stdout.str()
    assert _exports(counter) == ["good"]
    assert not list((pytester.path / ".pytest_cache").rglob("meta.json"))
    items = _items(pytester.path / "report.json")
    assert items["demo_pass[good-tiny-cpu]"]["outcome"] == "pass"
    assert items["demo_pass[good-tiny-cuda]"]["outcome"] == "fail"
    assert "--export-require-device is set" in items["demo_pass[good-tiny-cuda]"]["message"]
    assert items["demo_settings[good-cpu]"]["details"]["deadline"] == "0:00:01.234000"


def test_suite_runs_in_an_empty_directory(pytester: pytest.Pytester) -> None:
    """No test file, no conftest: --export-targets=all runs the suite and exits 0 when all pass."""
    result = pytester.runpytest(
        "--export-targets=all", "--export-checks=plugin_loads", "-p", "no:cacheprovider"
    )
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "collected * items",
            "*= exportcheck conformance matrix =*",
            "plugin_loads * 1/1 * 1/1 *",
        ]
    )
    assert "onnx" in result.stdout.str()


def test_faulty_plugins_are_caught_by_the_check_named_after_their_fault(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fake target or exporter that is wrong on purpose fails the check naming its fault."""
    site = install(pytester.path / "site")
    _env(pytester, monkeypatch)
    result = runpytest_installed(
        pytester,
        site,
        "--export-targets=good,perturb,inplace,swallow",
        "--export-models=iterable_moe",
        "--export-exporters=outside,zeroscale,brokenexp",
        "--export-checks=plugin_loads,roundtrip_logits,atomic_failure,unknown_kwargs,export_contract",
        "--export-report=report.json",
        "-p",
        "no:cacheprovider",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    items = _items(pytester.path / "report.json")
    failed = sorted(i for i, rec in items.items() if rec["outcome"] == "fail")
    assert failed == [
        "atomic_failure[inplace-cpu]",
        "export_contract[zeroscale]",
        "plugin_loads[brokenexp]",
        "roundtrip_logits[perturb-iterable_moe-cpu]",
        "unknown_kwargs[swallow-cpu]",
    ]
    assert "max abs" in items["roundtrip_logits[perturb-iterable_moe-cpu]"]["message"]
    assert items["roundtrip_logits[good-iterable_moe-cpu]"]["outcome"] == "pass"
    assert "holds a zero scale" in items["export_contract[zeroscale]"]["message"]
    # the exporter's own expected_failures attribute: strict, so the fault was caught
    assert items["export_contract[outside]"]["outcome"] == "xfail"
    assert "wrote outside its prefix" in items["export_contract[outside]"]["message"]
    assert DIST in items["plugin_loads[brokenexp]"]["message"]
    result.stdout.fnmatch_lines([r"check \ exporter * brokenexp * outside * zeroscale"])


def test_ini_twins_configure_the_suite(pytester: pytest.Pytester) -> None:
    """Each option has an ini key of the same name; the command line wins over it.
    The pytest_exportcheck_report hook receives the report."""
    pytester.makeini(
        "[pytest]\n"
        "export_targets = onnx,torchscript\n"
        "export_checks = plugin_loads\n"
        "export_report = from-ini.json\n"
    )
    pytester.makeconftest(
        "import json\n"
        "def pytest_exportcheck_report(config, report):\n"
        "    open('hook.json', 'w').write(json.dumps(report['totals']))\n"
    )
    result = pytester.runpytest("--export-targets=onnx")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["exportcheck: targets=onnx *checks=plugin_loads *"])
    hook = json.loads((pytester.path / "hook.json").read_text())
    assert hook == {"pass": 1, "fail": 0, "xfail": 0, "skip": 0}
    data = json.loads((pytester.path / "from-ini.json").read_text())
    assert [item["id"] for item in data["items"]] == ["plugin_loads[onnx]"]
    assert data["matrix"] == {
        "target": {"onnx": {"plugin_loads": {"pass": 1, "fail": 0, "xfail": 0, "skip": 0}}}
    }


def test_example_plugin_passes_the_suite(pytester: pytest.Pytester) -> None:
    """examples/exportlm-plugin-example, installed from its own pyproject's entry points,
    passes every check when its author runs plain ``pytest`` with its ini selection."""
    tomllib = pytest.importorskip("tomllib")
    example = Path(__file__).parents[1] / "examples" / "exportlm-plugin-example"
    project = tomllib.loads((example / "pyproject.toml").read_text())["project"]
    site = pytester.path / "site"
    make_distribution(site, project["name"], project["entry-points"], version=project["version"])
    (pytester.path / "pyproject.toml").write_text((example / "pyproject.toml").read_text())
    # no goldens/ here: the exporter's golden comes from the package (ModuleExporter.goldens)
    assert not (pytester.path / "goldens").exists()

    result = runpytest_installed(
        pytester,
        [site, example / "src"],
        "-p",
        "no:cacheprovider",
        "-W",
        "error::DeprecationWarning",
    )
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "exportcheck: targets=example_traced exporters=example_marked_linear models=example_tiny *",
            "exportcheck targets: *exportlm-plugin-example 0.1.0: example_traced*",
            "roundtrip_logits * 1/1",
            "export_contract * 1/1",
            "golden_checkpoint * 1/1",
        ]
    )


def test_cached_exports_serve_the_next_run_except_the_fresh_one_deterministic_needs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """artifact_contract and cache_wrapper use cached artifacts (the toy model's, and the
    check's own ``(logits, cache)`` model's), and so does ``deterministic`` for its first
    export (the family with one layer), so a second run exports only the one fresh copy
    ``deterministic`` compares that cached artifact with."""
    site = install(pytester.path / "site")
    counter = _env(pytester, monkeypatch)
    args = [
        "--export-targets=good",
        "--export-models=tiny",
        "--export-checks=artifact_contract,cache_wrapper,deterministic",
        "--export-report=report.json",
    ]
    first = runpytest_installed(pytester, site, *args)
    assert first.ret == pytest.ExitCode.OK, first.stdout.str()
    # tiny, cache_wrapper's model, deterministic's one-layer tiny and its fresh copy
    assert _exports(counter) == ["good"] * 4
    second = runpytest_installed(pytester, site, *args)
    assert second.ret == pytest.ExitCode.OK, second.stdout.str()
    assert _exports(counter) == ["good"] * 5
    items = _items(pytester.path / "report.json")
    assert items["artifact_contract[good-cpu]"]["details"] == {"companions": []}
    assert "identical outputs" in items["deterministic[good-cpu]"]["message"]
