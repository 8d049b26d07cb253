"""The coverage lockfile, pure: what counts as lost coverage, updates, bad files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pytest_exportcheck.session.coverage._lock import (
    LockError,
    Planned,
    compare,
    read_lock,
    updated,
    write_lock,
)

OLD = {
    "target": {
        "onnx": {
            "roundtrip_logits": {
                "roundtrip_logits[onnx-llama-cpu]": "pass",
                "roundtrip_logits[onnx-mixtral-cpu]": "pass",
                "roundtrip_logits[onnx-dbrx-cpu]": "skip",
            },
            "dynamic_shapes": {"dynamic_shapes[onnx-llama-cpu]": "pass"},
            "deterministic": {"deterministic[onnx-cpu]": "pass"},
        },
        "tflite": {"registered": {"registered[tflite-cpu]": "pass"}},
    }
}
PLANNED_IDS = {
    ("target", "onnx", "roundtrip_logits"): frozenset(
        {
            "roundtrip_logits[onnx-llama-cpu]",
            "roundtrip_logits[onnx-mixtral-cpu]",
            "roundtrip_logits[onnx-dbrx-cpu]",
            "roundtrip_logits[onnx-qwen2-cpu]",
        }
    ),
    ("target", "onnx", "deterministic"): frozenset({"deterministic[onnx-cpu]"}),
}


def _planned(selects: tuple[str, ...] = ()) -> Planned:
    return Planned(PLANNED_IDS, lambda check: not selects or check in selects)


def _ran(**outcomes: str) -> dict[str, dict[str, dict[str, dict[str, str]]]]:
    checks: dict[str, dict[str, str]] = {}
    for item_id, outcome in outcomes.items():
        checks.setdefault(item_id.split("[")[0], {})[item_id] = outcome
    return {"target": {"onnx": checks}}


RAN = {
    "roundtrip_logits[onnx-llama-cpu]": "skip",
    "roundtrip_logits[onnx-mixtral-cpu]": "xfail",
    "roundtrip_logits[onnx-dbrx-cpu]": "pass",
    "roundtrip_logits[onnx-qwen2-cpu]": "pass",
    "deterministic[onnx-cpu]": "pass",
}


def test_lost_coverage_fails_and_gains_are_noted() -> None:
    diff = compare(OLD, _ran(**RAN), _planned())
    assert diff.failures == [
        "check dynamic_shapes disappeared from target onnx (1 item(s) in the lockfile)",
        "roundtrip_logits[onnx-llama-cpu]: pass -> skip",
        "roundtrip_logits[onnx-mixtral-cpu]: pass -> xfail",
    ]
    assert diff.notes == [
        "roundtrip_logits[onnx-dbrx-cpu]: skip -> pass",
        "roundtrip_logits[onnx-qwen2-cpu]: new item (pass)",
    ]


def test_what_the_run_did_not_select_or_run_is_not_compared() -> None:
    # dynamic_shapes not selected; tflite not planned; the llama item planned but deselected
    ran = {k: v for k, v in RAN.items() if "llama" not in k and "mixtral" not in k}
    diff = compare(OLD, _ran(**ran), _planned(("roundtrip_logits", "deterministic")))
    assert diff.failures == []


def test_an_update_replaces_what_the_run_covered_and_keeps_the_rest() -> None:
    ran = {k: v for k, v in RAN.items() if "llama" not in k}
    new = updated(OLD, _ran(**ran), _planned())
    onnx = new["target"]["onnx"]
    assert "dynamic_shapes" not in onnx  # it disappeared: the update records that
    assert onnx["roundtrip_logits"]["roundtrip_logits[onnx-llama-cpu]"] == "pass"  # not run: kept
    assert onnx["roundtrip_logits"]["roundtrip_logits[onnx-mixtral-cpu]"] == "xfail"
    assert new["target"]["tflite"] == OLD["target"]["tflite"]  # not planned: kept


def test_a_check_that_cannot_apply_now_is_noted_if_it_only_skipped_and_fails_if_it_ran() -> None:
    """A lockfile written while not-applicable cells were skipped items reads as before; a
    row whose check ran and whose declaration now excludes it lost coverage."""
    old = {
        "target": {
            "onnx": {
                "loadable": {"loadable[onnx-llama-cpu]": "skip"},
                "dynamic_shapes": {"dynamic_shapes[onnx-llama-cpu]": "pass"},
            }
        }
    }
    why = {
        ("target", "onnx", "loadable"): "target 'onnx' writes a file artifact",
        ("target", "onnx", "dynamic_shapes"): "target 'onnx' does not declare 'dynamic_shapes'",
    }
    planned = Planned(PLANNED_IDS, lambda check: True, why)
    diff = compare(old, _ran(**RAN), planned)
    assert diff.failures == [
        "check dynamic_shapes disappeared from target onnx (1 item(s) in the lockfile, not "
        "applicable now: target 'onnx' does not declare 'dynamic_shapes')"
    ]
    assert diff.notes[0] == (
        "check loadable on target onnx is not applicable (target 'onnx' writes a file "
        "artifact): its 1 skipped item(s) in the lockfile are no items now"
    )
    assert "loadable" not in updated(old, _ran(**RAN), planned)["target"]["onnx"]


def test_the_lockfile_roundtrips_and_a_missing_one_is_none(tmp_path: Path) -> None:
    path = tmp_path / "exportcheck.lock"
    assert read_lock(path) is None
    write_lock(path, OLD)
    assert read_lock(path) == OLD


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{garbage", "cannot be read as JSON"),
        (json.dumps({"exportcheck_lock": 99, "items": {}}), "version 99"),
        (json.dumps([1, 2]), "version None"),
        (
            json.dumps({"exportcheck_lock": 1, "items": {"target": {"a": {"b": {"c": 3}}}}}),
            "'items'",
        ),
        (b"\xff\xfe", "cannot be read as JSON"),
    ],
)
def test_a_bad_lockfile_is_an_error_naming_the_file(
    tmp_path: Path, content: str | bytes, words: str
) -> None:
    path = tmp_path / "exportcheck.lock"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(LockError, match=rf"lockfile {path}: .*{words}"):
        read_lock(path)


def test_a_fifo_lockfile_is_refused_without_waiting(tmp_path: Path) -> None:
    path = tmp_path / "exportcheck.lock"
    os.mkfifo(path)
    with pytest.raises(LockError, match=r"lockfile .*FIFO"):
        read_lock(path)
