"""How the suite's failures reach the user: --pdb, -W error, JUnit XML.

Cheap setups: ``plugin_loads`` / ``registered`` items (no export) made to fail by
a strict expected failure, one TorchScript trace export for the warnings, and a
check registered by a ``conftest.py`` (in a subprocess, so it never joins this
process's catalogue) whose "code under test" raises.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import exportlm.export
import exportlm.models
import exportlm.module_exporters  # noqa: F401
import pytest_exportcheck.checks  # noqa: F401

SUITE = [
    "--export-targets=torch_export,torchscript",
    "--export-checks=plugin_loads,registered",
    "--export-xfails-file=xfails.txt",
]
FAILING = "exportcheck::plugin_loads::plugin_loads[torchscript:trace]"

RAISING_CHECK = '''
from pytest_exportcheck.checks import CheckResult, check


def author_export(case):
    raise ValueError(f"the author's exporter broke on {case.target_id}")


@check("demo_raises", scope="target")
def demo_raises(case):
    """Fails because the code under test raised, and says so."""
    try:
        author_export(case)
    except ValueError as err:
        return CheckResult.failed(f"export raised: {err}", exception=err)
    return CheckResult.passed()
'''

RECORDING_PDB = '''
import json
import pdb


class RecordingPdb(pdb.Pdb):
    """A debugger that records where its post-mortem would start, then returns."""

    def interaction(self, frame, tb_or_exc):
        tb = getattr(tb_or_exc, "__traceback__", tb_or_exc)  # Python >= 3.13 passes the exception
        while tb.tb_next is not None:
            tb = tb.tb_next
        code = tb.tb_frame.f_code
        with open("pdb-frames.jsonl", "a") as out:
            out.write(json.dumps({"function": code.co_name, "file": code.co_filename}) + "\\n")
'''


@pytest.fixture
def failing(pytester: pytest.Pytester) -> pytest.Pytester:
    """An xfails file that turns the passing ``plugin_loads[torchscript:trace]`` into a failure."""
    (pytester.path / "xfails.txt").write_text("exportcheck::plugin_loads[torchscript:trace]\n")
    return pytester


def test_pdb_starts_in_the_frame_that_raised(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest(RAISING_CHECK)
    pytester.makepyfile(recpdb=RECORDING_PDB)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    monkeypatch.setenv("COLUMNS", "250")  # FAILED lines in full
    result = pytester.runpytest_subprocess(
        "--export-targets=torchscript",
        "--export-checks=demo_raises",
        "-p",
        "no:cacheprovider",
        "--pdb",
        "--pdbcls=recpdb:RecordingPdb",
        "-rf",
    )
    frames = [
        json.loads(line) for line in (pytester.path / "pdb-frames.jsonl").read_text().splitlines()
    ]
    assert [f["function"] for f in frames] == ["author_export"] * 2  # one per failed item
    assert {Path(f["file"]).name for f in frames} == {"conftest.py"}
    # the report still reads as the check's message, not as a traceback
    result.stdout.fnmatch_lines(
        [
            "export raised: the author's exporter broke on torchscript:script",
            "FAILED exportcheck::demo_raises::demo_raises[[]torchscript:script-cpu] - "
            "CheckFailed: export raised: the author's exporter broke on torchscript:script",
        ]
    )
    assert "Traceback" not in result.stdout.str()


def test_warnings_of_an_export_do_not_fail_items_under_w_error(failing: pytest.Pytester) -> None:
    """torch's and exportlm's deprecation warnings are shown, not failures; failures still fail."""
    result = failing.runpytest(
        "--export-targets=torchscript",
        "--export-checks=plugin_loads,roundtrip_logits",
        "--export-models=decoder",
        "--export-xfails-file=xfails.txt",
        "-W",
        "error",
        "-rA",
    )
    result.stdout.fnmatch_lines(
        [
            "PASSED exportcheck::roundtrip_logits::roundtrip_logits[[]torchscript:trace-decoder-cpu]",
            "FAILED exportcheck::plugin_loads::plugin_loads[[]torchscript:trace]*",
        ]
    )
    assert "TorchScriptDeprecationWarning" in result.stdout.str()  # in the warnings summary
    result.assert_outcomes(passed=2, failed=1, xfailed=1, warnings=2)


def _suite_properties(root: ET.Element) -> list[tuple[str, str]]:
    suite = root.find("testsuite")
    assert suite is not None
    properties = suite.find("properties")
    assert properties is not None
    return [(p.attrib["name"], p.attrib["value"]) for p in properties.findall("property")]


def test_junit_xml_has_a_class_per_check_and_json_properties(failing: pytest.Pytester) -> None:
    xunit1 = failing.runpytest(*SUITE, "--junitxml=x1.xml", "-o", "junit_family=xunit1")
    xunit2 = failing.runpytest(*SUITE, "--junitxml=x2.xml")  # pytest's default family
    for result in (xunit1, xunit2):
        result.assert_outcomes(passed=5, failed=1)
        assert "junit_family" not in result.stdout.str()  # no incompatibility warning
    failed_line = next(line for line in xunit2.outlines if line.startswith("FAILED "))

    for name in ("x1.xml", "x2.xml"):
        root = ET.parse(failing.path / name).getroot()
        cases = root.findall(".//testcase")
        assert len(cases) == 6
        for case in cases:
            check = case.attrib["name"].split("[", 1)[0]
            assert case.attrib["classname"] == f"exportcheck.{check}"
        failure = next(c for c in cases if c.find("failure") is not None)
        # classname + name give back the node id the FAILED line printed (rerunnable)
        nodeid = "::".join([*failure.attrib["classname"].split("."), failure.attrib["name"]])
        assert nodeid == FAILING
        assert failed_line.split()[1] == FAILING
        suite = dict(_suite_properties(root))
        assert suite["exportcheck.version.torch"] == torch.__version__
        plugins = json.loads(suite["exportcheck.plugins"])
        assert {"kind": "target", "name": "torchscript"} in [
            {"kind": p["kind"], "name": p["name"]} for p in plugins
        ]
        assert json.loads(suite["exportcheck.options"])["targets"] == "torch_export,torchscript"

    # xunit1: per-item properties on each testcase, as JSON
    root1 = ET.parse(failing.path / "x1.xml").getroot()
    for case in root1.findall(".//testcase"):
        props = {p.attrib["name"]: p.attrib["value"] for p in case.iter("property")}
        assert json.loads(props["exportcheck"])["id"] == case.attrib["name"]
        assert json.loads(props["exportcheck.result"])["status"] == "pass"
    # xunit2 has no testcase properties: each item's record is a suite property
    root2 = ET.parse(failing.path / "x2.xml").getroot()
    assert all(case.find("properties") is None for case in root2.findall(".//testcase"))
    items = [json.loads(v) for n, v in _suite_properties(root2) if n == "exportcheck.item"]
    assert sorted(i["nodeid"] for i in items) == sorted(
        "::".join([*c.attrib["classname"].split("."), c.attrib["name"]])
        for c in root2.findall(".//testcase")
    )
    assert next(i for i in items if i["nodeid"] == FAILING)["outcome"] == "fail"
