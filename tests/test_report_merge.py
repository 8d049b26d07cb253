"""Merging exportcheck JSON reports and judging coverage (exportlm._matrix, `exportlm report`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from exportlm._matrix import MergeError, matrix_lines, matrix_of, merge_reports, unchecked_of
from exportlm.cli import main

VALUE = {"target": ["roundtrip_logits"], "exporter": ["golden_checkpoint"]}


def _item(
    check: str, column: str, outcome: str, scope: str = "target", **kw: Any
) -> dict[str, Any]:
    item_id = f"{check}[{column}{'-' + kw['model'] if 'model' in kw else ''}]"
    return {
        "id": item_id,
        "nodeid": f"exportcheck::{check}::{item_id}",
        "check": check,
        "scope": scope,
        "column": column,
        "outcome": outcome,
        "check_index": {"registered": 1, "roundtrip_logits": 3, "golden_checkpoint": 20}.get(
            check, 9
        ),
        **kw,
    }


ITEMS = [
    _item("registered", "onnx", "pass"),
    _item("roundtrip_logits", "onnx", "pass", model="llama"),
    _item("roundtrip_logits", "onnx", "fail", model="mixtral"),
    _item("registered", "lonely", "pass"),
    _item("roundtrip_logits", "lonely", "skip", model="llama"),
    _item("roundtrip_logits", "lonely", "xfail", model="mixtral"),
    _item("mro_match", "fp8", "pass", scope="exporter"),
    _item("golden_checkpoint", "fp8", "pass", scope="exporter"),
    _item("mro_match", "scaled", "pass", scope="exporter"),
    _item("golden_checkpoint", "scaled", "skip", scope="exporter"),
    _item("registered", "nothing_selected", "pass"),
]


def _report(items: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    return {
        "format": 2,
        "options": {"targets": "all", "models": "all", "device": "cpu", "shard": None, **options},
        "environment": {"exportlm": "0.2.0", "pytest_exportcheck": "0.2.0", "torch": "2.9"},
        "value_checks": VALUE,
        "cache": {"exports": 1},
        "items": items,
    }


def test_a_row_whose_value_checks_all_skipped_is_unchecked() -> None:
    assert unchecked_of(ITEMS, VALUE) == {"target": ["lonely"], "exporter": ["scaled"]}


def test_the_matrix_names_the_unchecked_rows_under_their_table() -> None:
    lines = matrix_lines(ITEMS, 120, VALUE)
    assert lines[0].split() == ["check", "\\", "target", "lonely", "nothing_selected", "onnx"]
    assert lines[1].split()[0] == "registered"  # catalogue order, not alphabetical
    assert "UNCHECKED target(s), no value check ran (all skipped or xfailed): lonely" in lines
    assert "UNCHECKED exporter(s), no value check ran (all skipped or xfailed): scaled" in lines


def test_two_halves_merge_into_the_matrix_of_the_whole() -> None:
    whole = matrix_of(ITEMS)
    a = _report(ITEMS[::2], shard="1/2")
    b = _report(ITEMS[1::2], shard="2/2", durations=5)
    merged = merge_reports([("a.json", a), ("b.json", b)])
    assert merged["matrix"] == whole
    assert merged["totals"] == {"pass": 7, "fail": 1, "xfail": 1, "skip": 2}
    assert merged["unchecked"] == {"target": ["lonely"], "exporter": ["scaled"]}
    assert merged["merged_from"] == ["a.json", "b.json"]
    assert merged["cache"] == {"exports": 2}
    assert "shard" not in merged["options"]


#: ``lonely`` and ``scaled`` cannot apply to a check each; ``ghost`` has only cells that cannot.
NOT_APPLICABLE = [
    {
        "scope": "target",
        "column": "lonely",
        "check": "generation_parity",
        "reason": "target 'lonely' does not declare 'kv_cache'",
        "items": 2,
        "check_index": 7,
    },
    {
        "scope": "exporter",
        "column": "scaled",
        "check": "fp8_gemm",
        "reason": "fp8_gemm runs on cuda devices only, not cpu",
        "items": 1,
        "check_index": 28,
    },
]


def test_a_cell_that_cannot_apply_is_a_dot_and_changes_no_verdict() -> None:
    lines = matrix_lines(ITEMS, 120, VALUE, not_applicable=NOT_APPLICABLE)
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.strip()}
    # the check's row appears in catalogue order, · where it cannot apply, - where no item ran
    assert [line.split()[0] for line in lines[1:4]] == [
        "registered",
        "roundtrip_logits",
        "generation_parity",
    ]
    assert rows["generation_parity"] == ["·", "-", "-"]
    assert rows["fp8_gemm"] == ["-", "·"]
    # a row is still judged on the value checks that apply: lonely and scaled stay unchecked
    assert "UNCHECKED target(s), no value check ran (all skipped or xfailed): lonely" in lines
    assert "UNCHECKED exporter(s), no value check ran (all skipped or xfailed): scaled" in lines
    assert "·" not in "".join(matrix_lines(ITEMS, 120, VALUE))  # without them, no · at all


def test_a_row_with_only_value_checks_that_cannot_apply_is_unchecked() -> None:
    """As it was when those cells were items that skipped."""
    items = [_item("registered", "ghost", "pass")]
    ghost = [{**NOT_APPLICABLE[0], "column": "ghost", "check": "roundtrip_logits"}]
    merged = merge_reports([("a", {**_report(items), "not_applicable": ghost})])
    assert merged["unchecked"] == {"target": ["ghost"]}
    assert merge_reports([("a", _report(items))])["unchecked"] == {}


def test_merge_keeps_each_cell_that_cannot_apply_once_with_its_reason() -> None:
    a = {**_report(ITEMS[::2], shard="1/2"), "not_applicable": NOT_APPLICABLE}
    b = {**_report(ITEMS[1::2], shard="2/2"), "not_applicable": NOT_APPLICABLE[:1]}
    merged = merge_reports([("a.json", a), ("b.json", b)])
    assert merged["not_applicable"] == NOT_APPLICABLE[::-1]  # sorted by scope, row, check
    assert merged["unchecked"] == {"target": ["lonely"], "exporter": ["scaled"]}
    for bad in ({"scope": "target"}, {**NOT_APPLICABLE[0], "items": -1}, "generation_parity"):
        with pytest.raises(MergeError, match="'not_applicable' is not a list of"):
            merge_reports([("c.json", {**_report(ITEMS), "not_applicable": [bad]})])


def test_an_item_in_two_reports_with_two_outcomes_is_refused_naming_it() -> None:
    changed = {**ITEMS[1], "outcome": "skip"}
    a, b = _report(ITEMS[:2], device="cpu"), _report(ITEMS[1:2], device="cuda")
    merged = merge_reports([("a", a), ("b", b)])
    assert len(merged["items"]) == 2  # the same outcome twice is one item
    with pytest.raises(MergeError, match=r"roundtrip_logits\[onnx-llama\]: pass in a, skip in b"):
        merge_reports([("a", a), ("b", _report([changed], device="cuda"))])


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (
            {"environment": {"exportlm": "0.3.0", "pytest_exportcheck": "0.2.0"}},
            "environment.exportlm",
        ),
        ({"options": {"targets": "onnx", "models": "all"}}, "options.targets"),
        ({"value_checks": {"target": []}}, "value_checks"),
    ],
)
def test_reports_of_different_runs_are_refused_naming_the_key(
    change: dict[str, Any], key: str
) -> None:
    other = {**_report(ITEMS[1:]), **change}
    with pytest.raises(MergeError, match=rf"b differs from a in {key}"):
        merge_reports([("a", _report(ITEMS[:1])), ("b", other)])


def test_the_cli_merges_prints_the_matrix_and_writes_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "all.json"
    a.write_text(json.dumps(_report(ITEMS[:5], shard="1/2")))
    b.write_text(json.dumps({**_report(ITEMS[5:], shard="2/2"), "not_applicable": NOT_APPLICABLE}))
    assert main(["report", "merge", str(a), str(b), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "UNCHECKED exporter(s), no value check ran (all skipped or xfailed): scaled" in printed
    assert re.search(r"^fp8_gemm +- +·$", printed, flags=re.MULTILINE), printed
    assert json.loads(out.read_text())["not_applicable"] == NOT_APPLICABLE[::-1]  # sorted
    assert "11 items from 2 report(s): 7 passed, 1 failed, 1 xfailed, 2 skipped" in printed
    assert json.loads(out.read_text())["matrix"] == matrix_of(ITEMS)
    assert main(["report", "merge", str(a), str(b), "--strict"]) == 1


def test_the_cli_refuses_unreadable_or_unmergeable_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, garbage, fifo = tmp_path / "good.json", tmp_path / "garbage.json", tmp_path / "fifo"
    good.write_text(json.dumps(_report(ITEMS)))
    garbage.write_text("{not json")
    os.mkfifo(fifo)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_report(ITEMS, models="llama")))
    for bad, words in [
        (garbage, "garbage.json: cannot be read as JSON"),
        (fifo, "fifo: cannot be read as JSON"),
        (tmp_path / "missing.json", "missing.json: cannot be read"),
        (other, "options.models"),
    ]:
        assert main(["report", "merge", str(good), str(bad)]) == 2
        assert words in capsys.readouterr().err


def test_the_built_in_value_checks_are_documented_per_scope() -> None:
    from pytest_exportcheck.checks.catalogue import BUILTIN_CHECKS
    from pytest_exportcheck.session.coverage._coverage import value_checks

    built_in = value_checks(BUILTIN_CHECKS)
    assert set(built_in) == {"target", "exporter"}
    docs = (Path(__file__).resolve().parents[1] / "docs" / "checks.md").read_text()
    for scope, checks in built_in.items():
        (row,) = [line for line in docs.splitlines() if line.startswith(f"| `{scope}` | ")]
        assert sorted(re.findall(r"`(\w+)`", row)[1:]) == sorted(checks)


def test_a_run_whose_every_selected_cell_cannot_apply_says_so() -> None:
    """``--export-checks=generation_parity --export-targets=hf_checkpoint``: no item, and why."""
    from pytest_exportcheck.session.reporting._report import ReportBuilder

    lines = ReportBuilder(not_applicable=NOT_APPLICABLE[:1]).summary_lines(100)
    assert lines[:2] == ["check \\ target     lonely", "generation_parity       ·"]
    assert any(
        line.startswith("  · not applicable: 1 (row, check) cell(s), 2 item(s) fewer")
        for line in lines
    ), lines
    assert ReportBuilder().summary_lines(100) == ["no exportcheck items ran"]
