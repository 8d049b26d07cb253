"""``exportlm inspect``: exit codes, the table, ``--json``, ``--rules``; ONNX files; the
``loadable`` conformance check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import exportlm
from exportlm.cli import main
from exportlm.inspection import RULES, Severity, inspect_checkpoint
from exportlm.models import build_model
from exportlm.quant import quantize
from pytest_exportcheck.checks import CHECKS, TargetCase
from tests._faulty_target import faulty_checkpoint_target

LM_HEAD_SCALE = "lm_head.input_scale"


def _export(tmp_path: Path, recipe: str = "nvfp4") -> Path:
    model = quantize(build_model("llama", seed=0), recipe)
    out: Path = exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt")
    return out


def _add_lm_head_input_scale(directory: Path) -> None:
    shard = directory / "model.safetensors"
    tensors = load_file(shard)
    tensors[LM_HEAD_SCALE] = torch.tensor(0.5)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_a_clean_checkpoint_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(_export(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "OK: 0 error(s)" in out
    assert "layout=modelopt" in out


def test_a_broken_checkpoint_exits_1_naming_rule_and_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = _export(tmp_path)
    _add_lm_head_input_scale(out_dir)
    assert main(["inspect", str(out_dir)]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "excluded-stray-scale" in line)
    assert row.split()[:3] == ["error", "excluded-stray-scale", LM_HEAD_SCALE]
    assert "FAIL: 1 error(s)" in out


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = _export(tmp_path)
    _add_lm_head_input_scale(out_dir)
    assert main(["inspect", str(out_dir), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["counts"]["error"] == 1
    (error,) = [f for f in report["findings"] if f["severity"] == "error"]
    assert (error["rule"], error["subject"]) == ("excluded-stray-scale", LM_HEAD_SCALE)
    assert error["reference"] == "docs/checkpoint-rules.md#excluded-stray-scale"


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "{tmp}/nowhere"], ["inspect", "{tmp}"]])
def test_usage_errors_exit_2(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("exportlm: error:")
    assert "PATH" in err or "expected" in err


def test_rules_lists_every_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--rules", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in listed] == list(RULES)
    assert main(["inspect", "--rules"]) == 0
    assert "lm_head.input_scale" in capsys.readouterr().out


# ----------------------------------------------------------------------------- ONNX files


def _onnx_model(dtype: int, opset: int) -> Any:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    codes = numpy_helper.from_array(np.arange(64, dtype=np.int8).reshape(8, 8), "w_codes")
    if dtype != TensorProto.INT8:  # reinterpret the bytes as another 1-byte dtype
        codes = helper.make_tensor("w_codes", dtype, [8, 8], codes.raw_data, raw=True)
    scale = numpy_helper.from_array(np.array(0.5, dtype=np.float32), "w_scale")
    node = helper.make_node("DequantizeLinear", ["w_codes", "w_scale"], ["w"])
    out = helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 8])
    graph = helper.make_graph([node], "g", [], [out], initializer=[codes, scale])
    return onnx, helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_an_fp8_onnx_file_reports_its_quantized_initializers(tmp_path: Path) -> None:
    onnx, model = _onnx_model(17, 19)  # 17: TensorProto.FLOAT8E4M3FN
    path = tmp_path / "m.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="m.onnx.data",
                    size_threshold=0)  # fmt: skip
    report = inspect_checkpoint(path)
    assert report.ok
    assert report.kind == "onnx"
    assert report.summary["quantized"] == {"FLOAT8E4M3FN": {"initializers": 1, "bytes": 64}}
    assert report.summary["external_files"] == ["m.onnx.data"]
    (info,) = report.findings
    assert (info.rule, info.severity) == ("onnx-quantized-initializers", Severity.INFO)


def test_an_onnx_opset_too_old_for_fp8_fails(tmp_path: Path) -> None:
    onnx, model = _onnx_model(17, 18)
    path = tmp_path / "m.onnx"
    onnx.save_model(model, path)
    assert [f.rule for f in inspect_checkpoint(path).errors] == ["onnx-opset"]


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_external_data_fails(damage: str, tmp_path: Path) -> None:
    onnx, model = _onnx_model(3, 13)  # 3: TensorProto.INT8
    path = tmp_path / "m.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="m.onnx.data",
                    size_threshold=0)  # fmt: skip
    data = tmp_path / "m.onnx.data"
    if damage == "missing":
        data.unlink()
    else:
        data.write_bytes(data.read_bytes()[:10])
    report = inspect_checkpoint(path)
    assert {(f.rule, f.subject) for f in report.errors} >= {("onnx-external-data", "w_codes")}
    assert main(["inspect", str(path)]) == 1


def test_a_file_that_is_not_onnx_fails(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    path = tmp_path / "m.onnx"
    path.write_bytes(b"\xff" * 64)
    assert [f.rule for f in inspect_checkpoint(path).errors] == ["onnx-unreadable"]


# ----------------------------------------------------------------------------- check `loadable`


@pytest.mark.parametrize("family", ["llama", "llama_tied", "mixtral", "dbrx", "decoder"])
def test_loadable_passes_on_hf_checkpoint(family: str, tmp_path: Path) -> None:
    result = CHECKS["loadable"].fn(TargetCase("hf_checkpoint", None, {}, family, "cpu",
                                              workdir=tmp_path))  # fmt: skip
    if family == "decoder":  # a plain torch model: the target's own reason, a counted skip
        assert result.status == "skip"
        assert "PreTrainedModel" in result.message
        return
    assert result.status == "pass", result.message
    expected = (
        ["fp8"]
        if family == "dbrx"
        else ["fp8+fp8_kv", "nvfp4", "int4_awq", "int8_wo", "int8_sq", "w8a8"]
    )
    assert list(result.details["checked"]) == expected
    assert all(c["error"] == 0 for c in result.details["checked"].values())


def test_loadable_skips_file_targets(tmp_path: Path) -> None:
    result = CHECKS["loadable"].fn(TargetCase("onnx", None, {}, "llama", "cpu", workdir=tmp_path))
    # onnx declares 'quantized' (FP8 QDQ) or not: a file target is a counted skip either way
    assert result.status == "skip"
    assert "'quantized'" in result.message or "writes a single file" in result.message
    assert CHECKS["loadable"].needs == frozenset({"quantized"})
    assert CHECKS["loadable"].per_model


def test_a_target_writing_a_stray_lm_head_scale_fails_loadable(tmp_path: Path) -> None:
    # FAULT (loadable): the vllm#45102 checkpoint
    with faulty_checkpoint_target("stray_scales", _add_lm_head_input_scale) as target:
        result = CHECKS["loadable"].fn(
            TargetCase(target, None, {}, "llama", "cpu", workdir=tmp_path)
        )
    assert result.status == "fail"
    assert f"[excluded-stray-scale] {LM_HEAD_SCALE}" in result.message
    assert len(result.details["problems"]) == 5  # one per recipe (LOADABLE_RECIPES)
