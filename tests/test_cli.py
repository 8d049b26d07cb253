"""The ``exportlm`` command line, called in-process through ``main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exportlm.cli import main

pytestmark = pytest.mark.filterwarnings(
    "ignore::exportlm.export.torchscript.TorchScriptDeprecationWarning"
)


def test_list_json_names_every_builtin_with_its_provider(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    targets = {t["name"]: t for t in listing["targets"]}
    assert targets["onnx"]["provider"] == "exportlm (built in)"
    for name in ("torchscript", "torch_export", "hf_checkpoint"):
        assert targets[name]["provider"].startswith("exportlm ")
        assert targets[name]["runtime_available"]
    exporters = [e["name"] for e in listing["module_exporters"]]
    assert exporters.index("quant_moe_linear") < exporters.index("quant_linear")  # match order
    assert "mixtral" in {m["name"] for m in listing["models"]}


def test_export_with_verify_reports_the_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "decoder.pt"
    assert (
        main(
            [
                "export",
                "--target",
                "torchscript",
                "--model",
                "decoder",
                "--out",
                str(out),
                "--verify",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert out.is_file()
    assert "exported decoder with torchscript" in text
    assert "verify: max abs 0," in text
    assert text.rstrip().endswith("OK")


def test_quantized_hf_checkpoint_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "llama-fp8"
    argv = ["export", "--target", "hf_checkpoint", "--model", "hf:llama", "--quantize", "fp8"]
    assert main([*argv, "--out", str(out), "--verify"]) == 0
    assert (out / "hf_quant_config.json").is_file()
    assert capsys.readouterr().out.rstrip().endswith("OK")


def test_unknown_target_and_option_are_errors_with_the_accepted_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["export", "--target", "nope", "--model", "decoder", "--out", str(tmp_path / "x")])
        == 2
    )
    assert "available: hf_checkpoint, onnx, torch_export, torchscript" in capsys.readouterr().err
    argv = ["export", "--target", "torchscript", "--model", "decoder", "-o", "methd='trace'"]
    assert main([*argv, "--out", str(tmp_path / "y.pt")]) == 2
    err = capsys.readouterr().err
    assert "'methd'" in err
    assert "method" in err
    assert not (tmp_path / "y.pt").exists()
