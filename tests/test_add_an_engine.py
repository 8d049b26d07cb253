"""docs/architecture.md, "How to add an engine", followed as written: the record and the
entry point saved from the page, the worker the page names (``tests/_engine_plugin.py``'s,
transformers in this interpreter: no engine venv), installed as a distribution; the
section's ``pytest`` command then passes ``served`` with the record's own tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._engine_plugin import ENGINE, engine_worker
from tests._installed import runpytest_installed
from tests._worked_example import worked_example


def test_the_worked_engine_touches_three_files_and_passes_served(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    example = worked_example("How to add an engine")
    assert sorted(example.files) == ["pyproject.toml", "toy_engine.py"]  # + the worker: 3
    plugin = example.install(tmp_path / "site", {"toy_engine_worker.py": engine_worker()})
    args = [*example.pytest_args, "-p", "no:randomly", "--export-report=r.json"]
    result = runpytest_installed(pytester, plugin, *args)
    result.assert_outcomes(passed=1)
    (item,) = json.loads((pytester.path / "r.json").read_text())["items"]
    assert item["id"] == f"served[hf_checkpoint-{ENGINE}-llama-cpu]"
    (row,) = item["details"]["served"]
    assert row["atol"] == 1e-4  # the tolerance on the record the page shows
