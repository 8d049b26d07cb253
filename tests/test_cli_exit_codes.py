"""Exit codes: 0 ok, 1 the work failed, 2 a usage error, 130 interrupted; one line on stderr."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from exportlm.cli import main
from exportlm.export import (
    EXPORT_REGISTRY,
    RUNTIME_REGISTRY,
    ensure_exporters_registered,
    export_target,
)


@export_target("cli_wrong_logits", runtime="cli_zeros", atol=1e-5, rtol=1e-5)
def _export_anything(model: Any, output_path: Path) -> Path:
    output_path.parent.mkdir(parents=True, exist_ok=True)
    output_path.write_text("not a model")
    return output_path


def _load_zeros(artifact: Path) -> Any:
    """A runtime whose logits are all zero: never the model's."""
    return lambda ids: torch.zeros(*ids.shape, 7)


@export_target("cli_crash", runtime="cli_zeros")
def _export_crash(model: Any, output_path: Path, *, how: str = "runtime") -> Path:
    if how == "interrupt":
        raise KeyboardInterrupt
    raise RuntimeError("exporter crashed\nwith a second line of detail")


@export_target("cli_no_runtime", runtime="cli_runtime_nobody_registered")
def _export_without_runtime(model: Any, output_path: Path) -> Path:
    return _export_anything(model, output_path)


@pytest.fixture
def fake_targets() -> Iterator[None]:
    ensure_exporters_registered()
    targets = {
        "cli_wrong_logits": _export_anything,
        "cli_crash": _export_crash,
        "cli_no_runtime": _export_without_runtime,
    }
    for name, factory in targets.items():
        EXPORT_REGISTRY.register(name, factory)
    RUNTIME_REGISTRY.register("cli_zeros", _load_zeros)
    yield
    for name in targets:
        EXPORT_REGISTRY.unregister(name)
    RUNTIME_REGISTRY.unregister("cli_zeros")


def _export(target: str, out: Path, *extra: str) -> list[str]:
    return ["export", "--target", target, "--model", "decoder", "--out", str(out), *extra]


@pytest.mark.usefixtures("fake_targets")
def test_a_verification_mismatch_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_export("cli_wrong_logits", tmp_path / "m.bin", "--verify")) == 1
    captured = capsys.readouterr()
    assert captured.out.rstrip().endswith("MISMATCH")
    assert captured.err.splitlines()[-1].startswith("exportlm: error: verification failed: ")


@pytest.mark.usefixtures("fake_targets")
def test_a_crash_is_one_line_and_the_traceback_needs_verbose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_export("cli_crash", tmp_path / "m.bin")) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "exportlm: error: RuntimeError: exporter crashed [1 more line(s) with -v]"
    )
    assert "Traceback" not in err
    assert main(_export("cli_crash", tmp_path / "m.bin", "-v")) == 1
    err = capsys.readouterr().err
    assert "exportlm: error: RuntimeError: exporter crashed\nwith a second line of detail" in err
    assert "Traceback (most recent call last)" in err
    assert 'raise RuntimeError("exporter crashed' in err


@pytest.mark.usefixtures("fake_targets")
def test_ctrl_c_exits_130(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_export("cli_crash", tmp_path / "m.bin", "-o", "how=interrupt")) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "exportlm: error: interrupted"


@pytest.mark.usefixtures("fake_targets")
def test_verify_without_the_runtime_is_a_usage_error_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.bin"
    assert main(_export("cli_no_runtime", out, "--verify")) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "exportlm: error: --verify: target 'cli_no_runtime' runs in runtime "
        "'cli_runtime_nobody_registered', which is not registered (see `exportlm list`); "
        "install the package that provides it, or drop --verify"
    ]
    assert not out.exists()
    assert main(_export("cli_no_runtime", out, "-q")) == 0  # without --verify it exports


def test_a_model_the_target_cannot_take_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_export("hf_checkpoint", tmp_path / "ckpt")) == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert line.startswith(
        "exportlm: error: export target 'hf_checkpoint' cannot export this model"
    )


def test_a_bad_model_spec_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text('{"family": "llama"}')
    out = tmp_path / "m.pt2"
    argv = ["export", "--target", "torch_export", "--model", str(spec), "--out", str(out)]
    assert main(argv) == 2
    assert f"--model {spec}: " in capsys.readouterr().err


def test_an_output_of_the_wrong_kind_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    assert (
        main(
            [
                "export",
                "--target",
                "hf_checkpoint",
                "--model",
                "llama",
                "--out",
                str(tmp_path / "file"),
            ]
        )
        == 2
    )
    assert "is a file; target 'hf_checkpoint' writes a directory" in capsys.readouterr().err
    assert main(_export("torch_export", tmp_path)) == 2
    err = capsys.readouterr().err
    assert (
        f"is a directory; target 'torch_export' writes a file: pass a file path such as {tmp_path / 'model.pt2'}"
        in err
    )


@pytest.mark.parametrize("size", ["abc", "0", "-1MB"])
def test_a_bad_shard_size_is_a_usage_error_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], size: str
) -> None:
    """It used to surface from the writer, after the model was quantized (minutes of
    calibration on a real model), as an export failure (1)."""
    out = tmp_path / "ckpt"
    argv = ["export", "--target", "hf_checkpoint", "--model", "llama", "--quantize", "fp8"]
    assert main([*argv, "--out", str(out), "-o", f"max_shard_size={size}"]) == 2
    err = capsys.readouterr().err
    assert f"-o max_shard_size={size}: max_shard_size" in err
    assert "quantiz" not in err  # refused before the recipe ran
    assert not out.exists()


@pytest.mark.parametrize(
    ("target", "options", "says"),
    [
        ("onnx", ["-o", "opset=0"], "opset must be an int ONNX opset version"),
        ("onnx", ["-o", "layout=bad"], "layout must be one of"),
        ("torch_export", ["-o", "kv_cache=true", "-o", "dynamic=false"], "needs dynamic=True"),
        ("hf_checkpoint", ["-o", "tokenizer=no-such-dir"], "is not a directory"),
        ("hf_checkpoint", ["--quantize", "fp8+"], "has an empty part"),
        ("hf_checkpoint", ["--quantize", "fp8++fp8_kv"], "has an empty part"),
    ],
)
def test_an_option_value_the_target_or_recipe_refuses_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, options: list[str], says: str
) -> None:
    """The target's own check of its options exited 1 ("the work failed"), as if a rerun
    could pass; ``fp8+`` was read as ``fp8``. The same command fails until it changes: 2."""
    out = tmp_path / (
        "m.onnx" if target == "onnx" else "m.pt2" if target == "torch_export" else "ckpt"
    )
    argv = ["export", "--target", target, "--model", "llama", "--out", str(out), *options]
    assert main(argv) == 2
    assert says in capsys.readouterr().err
    assert not out.exists()
