"""``benchmarks/compare_reports.py``: a cell that stopped being an item is no verdict change.

Run as a user runs it (``python benchmarks/compare_reports.py before.json after.json``)
over two reports written by hand: the items a not-applicable cell of the later report
left out were skips before (exit 0), or one of them ran (exit 1), or a row's coverage
verdict changed (exit 1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compare_reports.py"


def _item(check: str, column: str, model: str, outcome: str) -> dict[str, Any]:
    item_id = f"{check}[{column}-{model}-cpu]"
    return {"id": item_id, "scope": "target", "column": column, "check": check, "outcome": outcome}


BEFORE = [
    _item("roundtrip_logits", "onnx", "llama", "pass"),
    _item("loadable", "onnx", "llama", "skip"),
    _item("loadable", "onnx", "mixtral", "skip"),
]
#: onnx writes a file: loadable (a checkpoint directory check) cannot apply to it.
LOADABLE = {
    "scope": "target",
    "column": "onnx",
    "check": "loadable",
    "reason": "target 'onnx' writes a file artifact; loadable reads directory artifacts",
    "items": 2,
    "check_index": 13,
}


def _compare(tmp_path: Path, before: dict[str, Any], after: dict[str, Any]) -> tuple[int, str]:
    (tmp_path / "before.json").write_text(json.dumps(before))
    (tmp_path / "after.json").write_text(json.dumps(after))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "before.json", "after.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_skips_that_became_a_not_applicable_cell_are_no_verdict_change(tmp_path: Path) -> None:
    after = {"items": BEFORE[:1], "not_applicable": [LOADABLE]}
    rc, out = _compare(tmp_path, {"items": BEFORE}, after)
    assert rc == 0, out
    assert "before: 3 items, after: 1 items" in out
    assert "not applicable now, skips before (no verdict change): 2 items, 1 cells" in out
    assert "loadable x onnx: 2 (target 'onnx' writes a file artifact" in out
    assert "only in" not in out


def test_a_check_that_ran_and_cannot_apply_now_or_a_vanished_skip_is_a_change(
    tmp_path: Path,
) -> None:
    ran = [{**BEFORE[0]}, {**BEFORE[1], "outcome": "pass"}, BEFORE[2]]
    after = {"items": BEFORE[:1], "not_applicable": [LOADABLE]}
    rc, out = _compare(tmp_path, {"items": ran}, after)
    assert rc == 1
    assert "only in before: loadable[onnx-llama-cpu]" in out
    # the cell says it left out one item, two vanished: both are listed
    one = {**LOADABLE, "items": 1}
    rc, out = _compare(tmp_path, {"items": BEFORE}, {**after, "not_applicable": [one]})
    assert rc == 1
    assert "only in before: loadable[onnx-mixtral-cpu]" in out
    # no not_applicable section (a report of an older plugin): every vanished item is listed
    rc, out = _compare(tmp_path, {"items": BEFORE}, {"items": BEFORE[:1]})
    assert rc == 1
    assert "only in before: loadable[onnx-llama-cpu]" in out


def test_a_row_whose_coverage_verdict_changed_is_a_change(tmp_path: Path) -> None:
    before = {"items": BEFORE, "unchecked": {}}
    after = {"items": BEFORE, "unchecked": {"target": ["onnx"]}}
    rc, out = _compare(tmp_path, before, after)
    assert rc == 1
    assert "unchecked: {} -> {'target': ['onnx']}" in out
