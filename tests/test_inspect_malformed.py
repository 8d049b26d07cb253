"""``exportlm inspect`` refuses every malformed checkpoint of ``tests/_malformed.py`` (exit 1,
naming the rule and the file), and a FIFO or a device where it reads is exit 2, not a hang."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from exportlm.cli import main
from exportlm.errors import NotRegularFileError
from exportlm.inspection import RULES, Severity, inspect_checkpoint
from tests._malformed import CASES, SHARD, copy_base, export_bases


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return export_bases(tmp_path_factory.mktemp("bases"))


@pytest.mark.parametrize("base", ["single", "sharded"])
def test_the_bases_pass(bases: dict[str, Path], base: str) -> None:
    report = inspect_checkpoint(bases[base])
    assert report.ok, [f.message for f in report.errors]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_checkpoint_fails_naming_the_rule_and_the_file(
    case: str, bases: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = CASES[case]
    directory = copy_base(bases[spec.base], tmp_path / "ckpt")
    spec.mutate(directory)

    assert main(["inspect", str(directory), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    found = [f for f in report["findings"] if f["rule"] == spec.rule]
    assert found, [(f["rule"], f["subject"]) for f in report["findings"]]
    assert RULES[spec.rule].severity is Severity.ERROR
    assert all(f["severity"] == "error" for f in found)
    assert any(spec.file in f["subject"] or spec.file in f["message"] for f in found), found
    assert found[0]["reference"] == f"docs/checkpoint-rules.md#{spec.rule}"


def test_findings_name_the_tensor_of_a_header_defect(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    directory = copy_base(bases["single"], tmp_path / "ckpt")
    CASES["dtype-f99"].mutate(directory)
    (finding,) = [
        f for f in inspect_checkpoint(directory).errors if f.rule == "shard-dtype-unknown"
    ]
    assert (finding.subject, finding.details["tensor"]) == (SHARD, "lm_head.weight")
    assert "'F99'" in finding.message
    assert "lm_head.weight" in finding.message


@pytest.mark.parametrize("name", [SHARD, "config.json", "model.safetensors.index.json"])
def test_a_fifo_is_refused_with_exit_2_not_waited_on(
    name: str, bases: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = copy_base(bases["single"], tmp_path / "ckpt")
    (directory / name).unlink(missing_ok=True)
    os.mkfifo(directory / name)
    with pytest.raises(NotRegularFileError, match="FIFO"):
        inspect_checkpoint(directory)
    assert main(["inspect", str(directory)]) == 2
    err = capsys.readouterr().err
    assert name in err
    assert "FIFO" in err


def test_a_device_as_the_shard_is_refused(bases: dict[str, Path], tmp_path: Path) -> None:
    directory = copy_base(bases["single"], tmp_path / "ckpt")
    (directory / SHARD).unlink()
    (directory / SHARD).symlink_to("/dev/zero")  # a device that never ends
    assert main(["inspect", str(directory)]) == 2


def test_onnx_external_data_outside_the_directory_fails(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    tensor = helper.make_tensor("w", TensorProto.FLOAT, [4], [1.0, 2.0, 3.0, 4.0])
    for location in ("/etc/hostname", "../outside.bin"):
        tensor.ClearField("float_data")
        tensor.data_location = TensorProto.EXTERNAL
        del tensor.external_data[:]
        tensor.external_data.add(key="location", value=location)
        tensor.external_data.add(key="length", value="16")
        graph = helper.make_graph(
            [helper.make_node("Identity", ["w"], ["y"])],
            "g",
            [],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
            initializer=[tensor],
        )
        path = tmp_path / "model.onnx"
        onnx.save(helper.make_model(graph), str(path))
        report = inspect_checkpoint(path)
        (finding,) = [f for f in report.errors if f.rule == "onnx-external-data-path"]
        assert location in finding.message
        assert finding.subject == "w"
