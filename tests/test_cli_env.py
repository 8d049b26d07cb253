"""``exportlm env``: what a bug report needs, as text and as JSON."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import torch

from exportlm.cli import main


def _installed(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def test_env_json_reports_versions_cpu_cuda_variables_and_registries(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPORTLM_CLI_TEST_SETTING", "on")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for name in ("torch", "transformers", "onnx", "onnxruntime", "safetensors", "datasets"):
        assert report["packages"][name] == _installed(name)
    assert report["packages"]["pytest"] == pytest.__version__
    facts = report["torch"]
    assert facts["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["intra_op_threads"] == torch.get_num_threads()
    assert facts["calibration_half_matmuls"].startswith("calibration's in ")
    assert facts["cuda_available"] == torch.cuda.is_available()
    assert len(facts["cuda_devices"]) == (
        torch.cuda.device_count() if facts["cuda_available"] else 0
    )
    assert report["environment"]["EXPORTLM_CLI_TEST_SETTING"] == "on"
    assert report["environment"]["OMP_NUM_THREADS"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in report["environment"]
    assert "PATH" not in report["environment"]  # only variables that change exportlm
    registered = report["registered"]
    assert {"onnx", "torchscript", "torch_export", "hf_checkpoint"} <= set(registered["targets"])
    assert "quant_linear" in registered["module_exporters"]
    assert "llama" in registered["models"]
    assert registered["failed_plugins"] == []


def test_env_text_is_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("exportlm ")
    for heading in ("Packages:", "Torch:", "Environment:", "Registered:"):
        assert f"\n{heading}\n" in out
    assert "  torch " in out
    assert f"CPU capability  {torch.backends.cpu.get_cpu_capability()}" in out
    assert "bf16 matmuls    calibration's in " in out
    assert "Plugins that failed to load: none" in out
