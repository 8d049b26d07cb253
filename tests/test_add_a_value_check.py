"""docs/architecture.md, "How to add a value check", followed as written.

The page's ``conftest.py`` registers a plugin's own check with ``value=True``; run in a
subprocess (so it never joins this process's catalogue), the check counts in the
coverage verdict and the report exactly as a built-in value check does, and the same
check without ``value=True`` does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests._docblocks import ROOT, parse_blocks

PAGE = ROOT / "docs" / "architecture.md"
RUN = [
    "--export-targets=torch_export,hf_checkpoint",
    "--export-models=llama",
    "--export-checks=artifact_bytes",
    "--export-strict",
    "--export-report=r.json",
    "-p",
    "no:cacheprovider",
]


def _conftest() -> str:
    (block,) = [b for b in parse_blocks(PAGE) if b.directives().file == "conftest.py"]
    return block.source


def _summary_line() -> str:
    (block,) = [b for b in parse_blocks(PAGE) if "had no value check selected" in b.source]
    return block.source.strip()


@pytest.fixture
def documented(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("COLUMNS", "250")  # the summary line in full
    return pytester


def _report(pytester: pytest.Pytester) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(pytester.path, "r.json").read_text())
    return data


def test_a_plugins_check_declared_a_value_check_counts_in_coverage(
    documented: pytest.Pytester,
) -> None:
    documented.makeconftest(_conftest())
    result = documented.runpytest_subprocess(*RUN)
    result.assert_outcomes(passed=3, skipped=1)  # plugin_loads x2, artifact_bytes x2
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([_summary_line()])
    report = _report(documented)
    assert "artifact_bytes" in report["value_checks"]["target"]
    assert "artifact_bytes[torch_export-cpu]" in report["planned"]["target"]["torch_export"]
    # torch_export passed a value check: checked; hf_checkpoint skipped it: not judged
    assert report["not_selected"] == {"target": ["hf_checkpoint"]}
    assert report["unchecked"] == {}


def test_the_same_check_without_value_true_checks_no_row(documented: pytest.Pytester) -> None:
    source = _conftest()
    assert source.count(", value=True") == 1
    documented.makeconftest(source.replace(", value=True", ""))
    result = documented.runpytest_subprocess(*RUN)
    result.assert_outcomes(passed=3, skipped=1)
    report = _report(documented)
    assert "artifact_bytes" not in report["value_checks"]["target"]
    assert "artifact_bytes[torch_export-cpu]" not in report["planned"]["target"]["torch_export"]
    assert report["not_selected"] == {"target": ["hf_checkpoint", "torch_export"]}
