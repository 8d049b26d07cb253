"""docs/architecture.md, "How to add an export target", followed as written: the two files
saved and installed as a distribution, then the section's ``pytest`` command passes the
conformance suite with the new row (in-process pytester, the distribution on sys.path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._installed import runpytest_installed
from tests._worked_example import worked_example


def test_the_worked_target_touches_two_files_and_passes_the_suite(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    example = worked_example("How to add an export target")
    assert sorted(example.files) == ["pyproject.toml", "tiny_pt.py"]  # at most 3 files
    plugin = example.install(tmp_path / "site")
    result = runpytest_installed(
        pytester, plugin, *example.pytest_args, "-p", "no:randomly", "--export-report=r.json"
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0, result.stdout.str()
    assert outcomes.get("errors", 0) == 0, result.stdout.str()
    items = json.loads((pytester.path / "r.json").read_text())["items"]
    passed = {i["check"] for i in items if i["outcome"] == "pass" and i["column"] == "tiny_pt"}
    # the value checks of a target row, each a pass on the new target
    assert {"roundtrip_logits", "dynamic_shapes", "trust", "atomic_failure"} <= passed, passed
