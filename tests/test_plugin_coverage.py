"""Coverage in the verdict, end to end: the lockfile, --export-strict, shards + report merge.

Each run is in this process with a small distribution installed for it
(:func:`tests._installed.runpytest_installed`: the registries see it as a fresh
process would, and get their own entries back after): a target ``saver``
(torch.save of the model, a runtime that loads it) whose ``dynamic_shapes``
capability an environment variable switches, and a module exporter ``lonely`` that
claims a module no toy model contains, so every one of its value checks skips. Runs with xdist use one worker
(``-n 1 --dist loadgroup``): what they check happens on the controller (the lockfile,
the strict verdict, a shard's report), which one worker proves as two would; each
worker is a process that imports torch and transformers again (it finds the
distribution on the path the run hands it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from exportlm._matrix import matrix_of
from exportlm.cli import main
from tests._distinfo import make_distribution
from tests._installed import runpytest_installed

PLUGIN = '''
import os
import signal
from pathlib import Path

import torch

from exportlm.export import ExportCacheWrapper, atomic_output, export_target
from exportlm.module_exporters import QuantLinearExporter

CAPS = {"dynamic_shapes"} if os.environ.get("COVPLUGIN_DYNAMIC") == "1" else set()


@export_target("saver", runtime="saver", atol=1e-5, rtol=1e-5, capabilities=CAPS, suffix=".pt")
def export_saver(model, output_path, *, example_inputs=None):
    if os.environ.get("COVPLUGIN_SIGINT") == "1":  # a CI job cancelled in the middle of an item
        os.kill(os.getpid(), signal.SIGINT)
    with atomic_output(output_path) as tmp:
        torch.save(ExportCacheWrapper(model).eval(), tmp)
    return Path(output_path)


@export_target("picky", runtime="saver", accepts=lambda model: "it takes no toy model")
def export_picky(model, output_path, *, example_inputs=None):
    raise AssertionError("never called: it accepts no model")


def load_saver(artifact, *, device="cpu"):
    module = torch.load(artifact, weights_only=False, map_location=device).eval()

    def run(input_ids):
        with torch.no_grad():
            return module(input_ids.to(device))

    return run


class LonelyExporter(QuantLinearExporter):
    """Claims a module type that no toy model contains: nothing it writes is ever compared."""

    name = "lonely"
    keys = ("NoToyModelHasThisLinear",)
'''

ENTRY_POINTS = {
    "exportlm.export_backends": {
        "saver": "covplugin:export_saver",
        "picky": "covplugin:export_picky",
    },
    "exportlm.export_runtimes": {"saver": "covplugin:load_saver"},
    "exportlm.module_exporters": {"lonely": "covplugin:LonelyExporter"},
}
#: Eight families: with the capability off, dynamic_shapes cannot apply: 8 items fewer.
FAMILIES = "decoder,decoder_tied,llama,llama_tied,mixtral,qwen2_moe,qwen3_moe,dbrx"
XDIST = ("-n", "1", "--dist", "loadgroup")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_cuda: None) -> Path:
    root = tmp_path / "site"
    make_distribution(root, "covplugin", ENTRY_POINTS, {"covplugin.py": PLUGIN})
    monkeypatch.delenv("CI", raising=False)
    return root


def _report(pytester: pytest.Pytester, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((pytester.path / name).read_text())
    return data


SUITE = ["--export-targets=saver", "--export-checks=dynamic_shapes", f"--export-models={FAMILIES}"]


def test_the_lockfile_fails_when_a_capability_flag_makes_a_check_that_ran_inapplicable(
    pytester: pytest.Pytester, site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COVPLUGIN_DYNAMIC", "1")
    written = runpytest_installed(pytester, site, *SUITE, "--export-lock=update")
    written.assert_outcomes(passed=9)  # and plugin_loads
    lock = json.loads((pytester.path / "exportcheck.lock").read_text())
    assert set(lock["items"]["target"]["saver"]["dynamic_shapes"].values()) == {"pass"}

    monkeypatch.setenv("COVPLUGIN_DYNAMIC", "0")
    lost = runpytest_installed(pytester, site, *SUITE)
    lost.assert_outcomes(passed=1)  # plugin_loads: dynamic_shapes is no item of saver now
    assert lost.ret == pytest.ExitCode.TESTS_FAILED
    lost.stdout.fnmatch_lines(
        [
            "exportcheck lockfile */exportcheck.lock: FAILED, 1 change(s) lose coverage*",
            "  check dynamic_shapes disappeared from target saver (8 item(s) in the lockfile, "
            "not applicable now: target 'saver' does not declare 'dynamic_shapes' "
            "(declared: none))",
        ]
    )


def test_the_lockfile_is_compared_on_the_xdist_controller(
    pytester: pytest.Pytester, site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [f"dynamic_shapes[saver-{family}-cpu]" for family in FAMILIES.split(",")]
    entries = {"target": {"saver": {"dynamic_shapes": dict.fromkeys(ids, "pass")}}}
    lockfile = pytester.path / "exportcheck.lock"
    lockfile.write_text(json.dumps({"exportcheck_lock": 1, "items": entries}))
    monkeypatch.setenv("COVPLUGIN_DYNAMIC", "0")
    lost = runpytest_installed(pytester, site, *SUITE, *XDIST)
    lost.assert_outcomes(passed=1)
    assert lost.ret == pytest.ExitCode.TESTS_FAILED
    lost.stdout.fnmatch_lines(
        ["*FAILED, 1 change(s) lose coverage*", "  check dynamic_shapes disappeared from *"]
    )
    lockfile.write_text("{not json")
    bad = runpytest_installed(pytester, site, *SUITE)
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines([f"*exportcheck lockfile {lockfile}: cannot be read as JSON*"])


def test_strict_fails_on_a_row_whose_value_checks_all_skip(
    pytester: pytest.Pytester, site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # picky accepts no model: every value check skips, and every check is selected
    suite = ["--export-targets=picky", "--export-models=decoder"]
    monkeypatch.setenv("CI", "true")  # strict by default
    lenient = runpytest_installed(
        pytester, site, *suite, "--export-strict=off", "--export-report=r.json"
    )
    lenient.assert_outcomes(passed=2, skipped=8)  # 5 checks need capabilities picky lacks
    assert lenient.ret == 0
    lenient.stdout.fnmatch_lines(
        ["UNCHECKED target(s), no value check ran (all skipped or xfailed): picky"]
    )
    assert _report(pytester, "r.json")["unchecked"] == {"target": ["picky"]}

    failed = runpytest_installed(pytester, site, *suite, *XDIST)
    failed.assert_outcomes(passed=2, skipped=8)
    assert failed.ret == pytest.ExitCode.TESTS_FAILED
    failed.stdout.fnmatch_lines(
        ["exportcheck --export-strict: FAILED, 1 unchecked row(s) * target picky"]
    )

    # an accepted row is still reported unchecked, with its reason, and no longer fails
    allowed = runpytest_installed(
        pytester, site, *suite, "-o", "export_strict_allow=picky it takes no model (issue 99)"
    )
    assert allowed.ret == 0
    allowed.stdout.fnmatch_lines(
        [
            "UNCHECKED target(s), no value check ran (all skipped or xfailed): picky",
            "exportcheck --export-strict: picky is unchecked, allowed: it takes no model "
            "(issue 99)",
        ]
    )
    assert "FAILED" not in allowed.stdout.str()


def test_a_bad_shard_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--export-targets=torchscript", "--export-shard=3/2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--export-shard: expected K/N with 1 <= K <= N*3/2*"])


def test_two_shards_and_report_merge_give_the_matrix_of_one_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # torchscript:script is unchecked here (it scripts no family): under CI strict would
    # fail each run; the merge is the point, the strict verdict is tested above
    monkeypatch.delenv("CI", raising=False)
    suite = [
        "--export-targets=torchscript",
        "--export-models=llama,mixtral",
        "--export-checks=registered,roundtrip_logits,dynamic_shapes,generation_parity,trust",
        "-p",
        "no:randomly",
    ]
    whole = pytester.runpytest(*suite, "--export-report=whole.json")
    assert whole.ret == 0
    for k, extra in ((1, ()), (2, XDIST)):
        shard = pytester.runpytest(
            *suite, f"--export-shard={k}/2", f"--export-report=s{k}.json", *extra
        )
        assert shard.ret == 0
    one, two = _report(pytester, "s1.json"), _report(pytester, "s2.json")
    assert one["items"]
    assert two["items"]
    assert not {i["nodeid"] for i in one["items"]} & {i["nodeid"] for i in two["items"]}
    capsys.readouterr()
    # the merge reads and writes JSON only: the console script's entry point, in process
    reports = [str(pytester.path / name) for name in ("s1.json", "s2.json")]
    assert main(["report", "merge", *reports, "-o", str(pytester.path / "all.json")]) == 0
    merged = capsys.readouterr().out
    reference = _report(pytester, "whole.json")
    combined = _report(pytester, "all.json")
    assert combined["matrix"] == reference["matrix"] == matrix_of(reference["items"])
    assert combined["totals"] == reference["totals"]
    assert combined["unchecked"] == reference["unchecked"]
    assert "check \\ target" in merged
    assert f"{sum(reference['totals'].values())} items from 2 report(s)" in merged


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("--export-strict=maybe", "--export-strict: expected on or off, got 'maybe'"),
        ("--export-lock=sometimes", "--export-lock: expected one of check, update, off"),
        ("--export-shard=x", "--export-shard: expected K/N with 1 <= K <= N (e.g. 1/2), got 'x'"),
    ],
)
def test_bad_coverage_options_are_usage_errors(
    pytester: pytest.Pytester, arg: str, message: str
) -> None:
    result = pytester.runpytest("--export-targets=onnx", arg)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])
