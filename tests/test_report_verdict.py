"""`exportlm report merge` cannot be made to lie: every report is validated, and --strict
fails on what a run did not finish, failed, or never checked (issue 39, "reports that
cannot lie")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from exportlm._matrix import MergeError, coverage_of, merge_reports
from exportlm.cli import main
from tests.test_report_merge import ITEMS, VALUE, _item, _report


def _write(tmp_path: Path, name: str, data: Any) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _merge(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["report", "merge", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_an_unfinished_item_counts_as_failed_and_fails_strict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cancelled = [*ITEMS[:2], _item("roundtrip_logits", "onnx", "incomplete", model="qwen")]
    one = _write(tmp_path, "s1.json", {**_report(cancelled, shard="1/2"), "interrupted": True})
    two = _write(tmp_path, "s2.json", _report(ITEMS[3:5], shard="2/2"))
    code, out, _ = _merge(capsys, one, two, "-o", str(tmp_path / "all.json"))
    assert code == 0  # without --strict the merge only reports
    merged = json.loads((tmp_path / "all.json").read_text())
    assert merged["interrupted"] is True
    assert merged["interrupted_reports"] == [one]
    assert merged["matrix"]["target"]["onnx"]["roundtrip_logits"] == {
        "pass": 1,
        "fail": 1,
        "xfail": 0,
        "skip": 0,
    }
    assert f"{one}: interrupted; its unfinished items count as failed" in out
    code, out, _ = _merge(capsys, one, two, "--strict", "--allow-failed")
    assert code == 1
    assert f"{one}: the run was interrupted" in out
    assert "1 unfinished item(s): exportcheck::roundtrip_logits::roundtrip_logits[onnx-qwen]" in out


def test_strict_fails_on_a_failed_item_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    items = [ITEMS[0], ITEMS[1], ITEMS[2]]  # roundtrip_logits[onnx-mixtral] failed
    report = _write(tmp_path, "r.json", _report(items))
    code, out, _ = _merge(capsys, report, "--strict")
    assert code == 1
    assert "1 failed item(s): exportcheck::roundtrip_logits::roundtrip_logits[onnx-mixtral]" in out
    code, out, _ = _merge(capsys, report, "--strict", "--allow-failed")
    assert code == 0, out
    code, _, _ = _merge(capsys, report)
    assert code == 0


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


BAD_ITEMS: list[tuple[Any, str]] = [
    ({k: v for k, v in ITEMS[0].items() if k != "outcome"}, "outcome None is not one of"),
    ({**ITEMS[0], "outcome": None}, "outcome None is not one of"),
    ({**ITEMS[0], "outcome": ""}, "outcome '' is not one of"),
    ({**ITEMS[0], "outcome": "passed"}, "outcome 'passed' is not one of"),
    (5, "items[0] is a JSON int, not an item record"),
    ([], "items[0] is a JSON list, not an item record"),
    ({k: v for k, v in ITEMS[0].items() if k != "nodeid"}, "'nodeid' is missing"),
    ({**ITEMS[0], "scope": 3}, "'scope' is missing or not a name"),
    ({**ITEMS[0], "check_index": "x"}, "'check_index' is not an integer"),
    ({**ITEMS[0], "model": {"a": 1}}, "'model' is not a name or null"),
    ({**ITEMS[0], "details": json.loads(_deep(40))}, "nested deeper than 32 levels"),
]


@pytest.mark.parametrize(("item", "words"), BAD_ITEMS)
def test_a_malformed_item_is_refused_naming_the_file_and_item(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], item: Any, words: str
) -> None:
    bad = _write(tmp_path, "bad.json", _report([item, *ITEMS[1:3]]))
    code, out, err = _merge(capsys, bad)
    assert code == 2, out
    assert f"report {bad}: " in err
    assert words in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"format": 99}, "report format 99, this exportlm reads format 2"),
        ({"format": None}, "report format None"),
        ({"options": []}, "'options' is not an object"),
        ({"environment": "x"}, "'environment' is not an object"),
        ({"value_checks": {"target": 5}}, "'value_checks.target' is not a list"),
        ({"planned": {"target": {"onnx": "x"}}}, "'planned.target.onnx' is not a list"),
        ({"declared_unchecked": {"target": ["x"]}}, "is not {row: reason}"),
        ({"interrupted": "no"}, "'interrupted' is not true or false"),
        ({"cache": {"exports": "1"}}, "'cache' is not an object of counts"),
        ({"items": [ITEMS[0], ITEMS[0]]}, "is listed twice"),
        ({"options": {"shard": "3/2"}}, "shard '3/2' is not K/N"),
    ],
)
def test_a_malformed_report_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, Any], words: str
) -> None:
    bad = _write(tmp_path, "bad.json", {**_report(ITEMS), **change})
    code, _, err = _merge(capsys, bad)
    assert code == 2
    assert f"report {bad}: " in err
    assert words in err


@pytest.mark.parametrize("text", [_deep(100_000), '{"a":' * 100_000 + "1" + "}" * 100_000, "[]"])
def test_deeply_nested_or_non_object_json_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    bad = _write(tmp_path, "deep.json", text)
    code, _, err = _merge(capsys, bad)
    assert code == 2
    assert "deep.json" in err
    assert "RecursionError" not in err


@pytest.mark.parametrize(
    ("shards", "words"),
    [
        (["1/2", "1/2"], "shard 1/2 of the job (device='cpu', require_device=None, engines=None"),
        (["1/2"], "shard(s) 2/2 of the job"),
        (["1/3", "2/3"], "shard(s) 3/3 of the job"),
        (["1/2", "2/3"], "split the suite differently"),
        ([None, "1/2"], "is its whole run"),
        ([None, None], "is its whole run"),
    ],
)
def test_shards_must_be_distinct_and_complete(shards: list[str | None], words: str) -> None:
    reports = [(f"s{i}.json", _report(ITEMS[i : i + 1], shard=s)) for i, s in enumerate(shards)]
    with pytest.raises(MergeError) as info:
        merge_reports(reports)
    assert words in str(info.value)


def test_shard_one_twice_and_two_missing_is_refused_by_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = _write(tmp_path, "s1.json", _report(ITEMS[:3], shard="1/2"))
    again = _write(tmp_path, "s1-again.json", _report(ITEMS[:3], shard="1/2"))
    code, _, err = _merge(capsys, one, again, "--strict")
    assert code == 2
    assert f"given twice: {one} and {again}" in err
    # the shards of each device are judged apart: two devices' whole runs merge
    cpu = _write(tmp_path, "cpu.json", _report(ITEMS[:3]))
    cuda = _write(tmp_path, "cuda.json", _report(ITEMS[3:], device="cuda"))
    assert _merge(capsys, cpu, cuda)[0] == 0


def test_declared_and_narrowed_rows_are_shown_and_do_not_fail_strict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    items = [ITEMS[0], ITEMS[1], ITEMS[3], ITEMS[4], ITEMS[5], ITEMS[8], ITEMS[9]]
    planned = {
        "target": {"lonely": [ITEMS[4]["id"], ITEMS[5]["id"]], "onnx": [ITEMS[1]["id"]]},
        # scaled's golden skipped, and its other value check was deselected (-k golden)
        "exporter": {"scaled": [ITEMS[9]["id"], "export_contract[scaled]"]},
    }
    declared = {"target": {"lonely": "no toy model has its module"}}
    report = {**_report(items), "planned": planned, "declared_unchecked": declared}
    coverage = coverage_of(items, VALUE, planned, declared)
    assert coverage.unchecked == {}
    assert coverage.declared == declared
    assert coverage.not_selected == {"exporter": ["scaled"]}
    code, out, _ = _merge(capsys, _write(tmp_path, "r.json", report), "--strict")
    assert code == 0, out
    assert (
        "declared unchecked target lonely (its declaration, not a failure): "
        "no toy model has its module" in out
    )
    assert "not selected exporter(s), no value check of theirs selected" in out
    # the same row, nothing deselected: unchecked, and strict fails on it
    planned["exporter"]["scaled"] = [ITEMS[9]["id"]]
    code, out, _ = _merge(
        capsys, _write(tmp_path, "r2.json", {**report, "planned": planned}), "--strict"
    )
    assert code == 1
    assert "1 unchecked row(s): exporter scaled" in out
