"""``exportlm inspect``'s loader table: which engine takes which (quant_method, algorithm).

One test per table row: vLLM 0.32's ModelOpt config validation accepts only the
``quant_algo`` values of its ``QUANT_ALGOS`` (measured: our ``W8A16`` and
``W4A16_AWQ`` checkpoints are refused there), SGLang's only FP8 and NVFP4 (NVFP4_*
normalized); inspect must never list such an engine as loading the checkpoint, and
names the layout that works instead.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

import exportlm
from exportlm.inspection import InspectionReport, Severity, inspect_checkpoint
from exportlm.models import build_model
from exportlm.quant import quantize

VLLM_ACCEPTS = (
    "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8",
    "MIXED_PRECISION",
)  # fmt: skip


@functools.cache
def _quantized(recipe: str) -> Any:
    return quantize(build_model("llama", seed=0), recipe)


def _export(tmp_path: Path, recipe: str) -> Path:
    out: Path = exportlm.export_model("hf_checkpoint", _quantized(recipe), tmp_path / recipe)
    return out


def _with_algo(directory: Path, algo: str) -> Path:
    """The same checkpoint declaring another ``quant_algo`` (both ModelOpt config files)."""
    hf = directory / "hf_quant_config.json"
    data = json.loads(hf.read_text())
    data["quantization"]["quant_algo"] = algo
    hf.write_text(json.dumps(data))
    config = directory / "config.json"
    data = json.loads(config.read_text())
    data["quantization_config"]["quant_algo"] = algo
    config.write_text(json.dumps(data))
    return directory


def _refusing(report: InspectionReport) -> dict[str, Any]:
    return {
        str(f.details["engine"]): f for f in report.findings if f.rule == "engine-refuses-scheme"
    }


def _loaders(report: InspectionReport) -> dict[str, Any]:
    (info,) = [f for f in report.findings if f.rule == "quant-method-loaders"]
    return dict(info.details)


@pytest.mark.parametrize(("recipe", "algo"), [("int8_wo", "W8A16"), ("int4_awq", "W4A16_AWQ")])
def test_vllm_and_sglang_refuse_our_modelopt_integer_checkpoints(
    tmp_path: Path, recipe: str, algo: str
) -> None:
    report = inspect_checkpoint(_export(tmp_path, recipe))
    refusing = _refusing(report)
    assert set(refusing) == {"vLLM 0.32", "SGLang"}
    vllm = refusing["vLLM 0.32"]
    assert vllm.severity is Severity.WARNING
    assert vllm.details["scheme"] == algo
    assert "ModelOpt currently only supports" in vllm.message
    assert "compressed-tensors" in vllm.details["instead"]  # the layout that works
    loaders = _loaders(report)
    assert loaders["known"] == ["TensorRT-LLM"]
    assert loaders["refused"] == ["SGLang", "vLLM 0.32"]


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_our_modelopt_fp8_and_nvfp4_checkpoints_pass_every_engine_table(
    tmp_path: Path, recipe: str
) -> None:
    report = inspect_checkpoint(_export(tmp_path, recipe))
    assert _refusing(report) == {}
    assert {"vLLM", "SGLang", "TensorRT-LLM"} <= set(_loaders(report)["known"])


@pytest.mark.parametrize("algo", VLLM_ACCEPTS)
def test_vllm_row_accepts_exactly_its_quant_algos(tmp_path: Path, algo: str) -> None:
    report = inspect_checkpoint(_with_algo(_export(tmp_path, "fp8"), algo))
    assert "vLLM 0.32" not in _refusing(report)


@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ", "W4A8_AWQ", "INT8", "w8a16"])
def test_vllm_row_refuses_every_other_quant_algo(tmp_path: Path, algo: str) -> None:
    report = inspect_checkpoint(_with_algo(_export(tmp_path, "fp8"), algo))
    assert _refusing(report)["vLLM 0.32"].details["scheme"] == algo
    assert "vLLM" not in _loaders(report)["known"]


@pytest.mark.parametrize(
    ("algo", "refused"),
    [("FP8", False), ("NVFP4", False), ("NVFP4_AWQ", False), ("FP8_PB_WO", True)],
)
def test_sglang_row_accepts_fp8_and_nvfp4_variants_only(
    tmp_path: Path, algo: str, refused: bool
) -> None:
    report = inspect_checkpoint(_with_algo(_export(tmp_path, "fp8"), algo))
    assert ("SGLang" in _refusing(report)) is refused


def test_compressed_tensors_checkpoints_have_no_modelopt_refusal(tmp_path: Path) -> None:
    out = exportlm.export_model(
        "hf_checkpoint", _quantized("fp8"), tmp_path / "ct", format="compressed-tensors"
    )
    assert _refusing(inspect_checkpoint(out)) == {}
