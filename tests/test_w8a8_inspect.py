"""``exportlm inspect`` on both INT8 SmoothQuant layouts: what each engine loads.

* ModelOpt ``W8A8_SQ_PER_CHANNEL`` (``int8_sq``): TensorRT-LLM reads it; vLLM 0.32
  refuses it at config validation (not in its ModelOpt ``QUANT_ALGOS``) and SGLang
  (FP8 / NVFP4 only), each naming the compressed-tensors ``w8a8`` layout instead.
* compressed-tensors ``int-quantized`` W8A8 (``w8a8``): no refusal; listed for vLLM
  (served: ``served[hf_checkpoint-vllm-llama-cpu]``), SGLang and transformers
  (``tests/test_w8a8_transformers.py``), not TensorRT-LLM.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import exportlm
from exportlm.inspection import InspectionReport, Severity, inspect_checkpoint
from exportlm.models import build_model
from exportlm.quant import quantize


@functools.cache
def _quantized(recipe: str) -> Any:
    return quantize(build_model("llama", seed=0), recipe)


def _findings(report: InspectionReport, rule: str) -> list[Any]:
    return [f for f in report.findings if f.rule == rule]


def _loaders(report: InspectionReport) -> dict[str, Any]:
    (info,) = _findings(report, "quant-method-loaders")
    return dict(info.details)


def test_inspect_says_vllm_and_sglang_refuse_the_modelopt_smoothquant_layout(
    tmp_path: Path,
) -> None:
    out = exportlm.export_model("hf_checkpoint", _quantized("int8_sq"), tmp_path / "mo")
    report = inspect_checkpoint(out)
    assert report.errors == []
    refusing = {str(f.details["engine"]): f for f in _findings(report, "engine-refuses-scheme")}
    assert set(refusing) == {"vLLM 0.32", "SGLang"}
    assert all(f.severity is Severity.WARNING for f in refusing.values())
    assert {f.details["scheme"] for f in refusing.values()} == {"W8A8_SQ_PER_CHANNEL"}
    assert "recipe 'w8a8'" in refusing["vLLM 0.32"].details["instead"]
    loaders = _loaders(report)
    assert loaders["known"] == ["TensorRT-LLM"]
    assert loaders["refused"] == ["SGLang", "vLLM 0.32"]


def test_inspect_lists_vllm_and_transformers_for_the_compressed_tensors_w8a8_layout(
    tmp_path: Path,
) -> None:
    out = exportlm.export_model(
        "hf_checkpoint", _quantized("w8a8"), tmp_path / "ct", format="compressed-tensors"
    )
    report = inspect_checkpoint(out)
    assert report.errors == []
    assert _findings(report, "engine-refuses-scheme") == []
    loaders = _loaders(report)
    assert loaders["refused"] == []
    assert {"vLLM", "SGLang"} <= set(loaders["known"])
    assert any(name.startswith("transformers") for name in loaders["known"])
    assert "TensorRT-LLM" not in loaders["known"]
