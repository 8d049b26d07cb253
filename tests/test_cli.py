"""The ``exportlm`` command line, called in-process through ``main``: list and export."""

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
    assert listing["failed_plugins"] == []


def test_list_prints_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for heading in ("Export targets:", "Runtimes:", "Module exporters (match order):"):
        assert heading in out
    assert "Model families:" in out
    assert "  torch_export " in out


def test_export_with_verify_reports_the_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "decoder.pt"
    argv = ["export", "--target", "torchscript", "--model", "decoder", "--out", str(out)]
    assert main([*argv, "--verify"]) == 0
    captured = capsys.readouterr()
    assert out.is_file()
    assert "exported decoder with torchscript" in captured.out
    assert "verify: max abs 0," in captured.out
    assert captured.out.rstrip().endswith("OK")
    # Progress lines go to stderr, the result to stdout.
    assert "exportlm: exporting to torchscript..." in captured.err
    assert "exportlm:" not in captured.out


def test_quantized_hf_checkpoint_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "llama-fp8"
    argv = ["export", "--target", "hf_checkpoint", "--model", "hf:llama", "--quantize", "fp8"]
    assert main([*argv, "--out", str(out), "--verify"]) == 0
    assert (out / "hf_quant_config.json").is_file()
    captured = capsys.readouterr()
    assert captured.out.rstrip().endswith("OK")
    assert "quantized 14 modules (fp8)" in captured.err
    assert "warning: calibrating on synthetic random input ids" in captured.err
    assert "--calib-data PATH" in captured.err


def test_export_json_lists_the_files_their_sizes_and_the_verification(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "llama"
    argv = ["export", "--target", "hf_checkpoint", "--model", "llama", "--out", str(out)]
    assert main([*argv, "--verify", "--json", "-o", "max_shard_size=200000"]) == 0
    result = json.loads(capsys.readouterr().out)  # stdout holds only the JSON object
    assert result["target"] == "hf_checkpoint"
    assert result["path"] == str(out)
    assert result["options"] == {"max_shard_size": 200000}
    on_disk = {str(p): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    assert {f["path"]: f["bytes"] for f in result["files"]} == on_disk
    assert sum(1 for name in on_disk if name.endswith(".safetensors")) > 1  # sharded
    assert result["bytes"] == sum(on_disk.values())
    assert result["seconds"] > 0
    assert result["verify"]["passed"] is True
    assert result["verify"]["max_abs"] <= result["verify"]["atol"]
    assert result["quantize"] is None
    assert result["calibration"] is None


def test_export_json_of_a_file_target_without_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.pt2"
    argv = ["export", "--target", "torch_export", "--model", "decoder", "--out", str(out), "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    manifest = out.with_name(out.name + ".manifest.json")  # exportlm's manifest, written last
    assert result["files"] == [
        {"path": str(p), "bytes": p.stat().st_size} for p in sorted([out, manifest])
    ]
    assert result["verify"] is None


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


def test_an_existing_checkpoint_directory_needs_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ckpt"
    argv = ["export", "--target", "hf_checkpoint", "--model", "llama", "--out", str(out), "-q"]
    assert main(argv) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "exists and is not empty; pass -o overwrite=true" in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert main([*argv, "-o", "overwrite=true"]) == 0
