"""``config-field-invalid`` for a ModelOpt ``group_size`` that is not a positive int.

An INT4 AWQ checkpoint whose ``hf_quant_config.json`` says ``group_size: 0`` (or -1, or
``"128"``) passed ``inspect`` as OK and loaded in exportlm (found 2026-12-06); vLLM's NVFP4
divides the input features by it. Written, it must be a positive int; ``null`` is as if
absent (the loaders' default).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import exportlm
from exportlm.errors import MalformedCheckpointError
from exportlm.export.guard import UnverifiedArtifactWarning
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize


@pytest.fixture(scope="module")
def int4_awq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_hf_model("llama", seed=0, hidden_size=256, intermediate_size=512)
    quantize(model, "int4_awq")
    out = tmp_path_factory.mktemp("mo") / "int4_awq"
    return exportlm.export_model("hf_checkpoint", model, out)


def _edited(source: Path, tmp_path: Path, size: Any) -> Path:
    """An unsigned copy of ``source`` whose ``hf_quant_config.json`` says ``group_size: size``."""
    out = tmp_path / "edited"
    out.mkdir()
    for path in source.iterdir():
        if path.name != "exportlm-manifest.json":
            out.joinpath(path.name).write_bytes(path.read_bytes())
    config = json.loads((out / "hf_quant_config.json").read_text())
    config["quantization"]["group_size"] = size
    (out / "hf_quant_config.json").write_text(json.dumps(config))
    return out


def _invalid(report: Any) -> list[Any]:
    return [f for f in report.errors if f.rule == "config-field-invalid"]


@pytest.mark.parametrize("size", [128, None], ids=["written", "null"])
def test_a_positive_or_null_group_size_is_no_finding(
    int4_awq: Path, tmp_path: Path, size: Any
) -> None:
    assert _invalid(inspect_checkpoint(_edited(int4_awq, tmp_path, size))) == []


@pytest.mark.parametrize("size", [0, -1, "128", True], ids=["zero", "minus-one", "string", "bool"])
def test_another_group_size_is_an_error_and_the_loader_refuses_it(
    int4_awq: Path, tmp_path: Path, size: Any
) -> None:
    edited = _edited(int4_awq, tmp_path, size)
    (found,) = _invalid(inspect_checkpoint(edited))
    assert found.subject == "hf_quant_config.json"
    assert f"quantization group_size is {size!r}, expected a positive int" in found.message
    with pytest.warns(UnverifiedArtifactWarning), pytest.raises(MalformedCheckpointError) as err:
        exportlm.load_exported("hf_checkpoint", edited)
    assert f"group_size is {size!r}" in str(err.value)
