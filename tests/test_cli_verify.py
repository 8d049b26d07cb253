"""``exportlm verify PATH --engine NAME``: exit 0 / 1 with the table, 2 for bad input.

The real run uses the transformers engine in this interpreter (transformers imports
here), so it needs no engine venv; the usage errors start no engine at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import exportlm
from exportlm.cli import main
from exportlm.models import build_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "ck"
    return exportlm.export_model("hf_checkpoint", build_model("llama", seed=0), out)


def test_an_unquantized_checkpoint_is_its_own_reference_and_passes(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EXPORTLM_ENGINE_TRANSFORMERS", raising=False)
    code = main(["verify", str(checkpoint), "--engine", "transformers", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 0, row
    assert (row["engine"], row["outcome"], row["tokens_equal"]) == ("transformers", "passed", True)
    assert row["max_gap"] <= row["atol"] == 1e-4


def test_the_wrong_reference_fails_with_exit_1_and_names_the_divergence(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EXPORTLM_ENGINE_TRANSFORMERS", raising=False)
    code = main(
        ["verify", str(checkpoint), "--engine", "transformers", "--model", "llama", "--seed", "1"]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "failed" in out
    assert "transformers" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "no-such-engine"], "unknown engine 'no-such-engine'"),
        (["--engine", "sglang"], "sglang does not import"),
        (["--engine", "openvino", "--python", "/no/such/python"], "not an executable Python"),
    ],
)
def test_an_engine_that_cannot_run_is_a_usage_error(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["verify", str(checkpoint), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "fp99"], "argument --dtype: expected bfloat16, float16 or float32"),
        (["--timeout", "-1"], "argument --timeout: expected a positive number of seconds"),
        (["--timeout", "0"], "argument --timeout: expected a positive number of seconds"),
        (["--timeout", "nan"], "argument --timeout: expected a positive number of seconds"),
        # raised as a raw ValueError (exit 1) after the reference model was built
        (
            ["--model", "llama", "--quantize", "int4_awq:group_size=7"],
            "--quantize int4_awq:group_size=7: recipe 'int4_awq': group_size=7 is not one",
        ),
    ],
)
def test_a_bad_dtype_or_timeout_is_refused_before_the_reference_is_computed(
    checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    """Both were taken: ``--dtype fp99`` failed only after the eager reference was computed
    ("no tolerance stated ... at fp99"), ``--timeout -1`` timed the engine out at once."""
    import exportlm.cli._model as cli_model
    import exportlm.engines.compare as compare

    monkeypatch.setattr(compare, "choose_prompts", lambda *a, **k: pytest.fail("computed"))
    monkeypatch.setattr(cli_model, "resolve_model", lambda *a, **k: pytest.fail("built"))
    assert main(["verify", str(checkpoint), "--engine", "transformers", *argv]) == 2
    assert message in capsys.readouterr().err


def test_garbage_is_a_usage_error_naming_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    graph = tmp_path / "model.onnx"
    graph.write_bytes(b"\x00garbage, not protobuf\xff" * 10)
    assert main(["verify", str(graph), "--engine", "transformers", "--model", "llama"]) == 2
    assert "is not an ONNX model" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["verify", str(empty), "--engine", "transformers"]) == 2
    assert "is not an artifact an engine serves" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "missing"), "--engine", "transformers"]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_a_quantized_or_onnx_artifact_needs_its_eager_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    graph = exportlm.export_model("onnx", build_model("llama"), tmp_path / "model.onnx")
    assert main(["verify", str(graph), "--engine", "transformers"]) == 2
    assert "give its eager reference with --model" in capsys.readouterr().err


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy llama fake-quantized with FP8 (calibrated on its synthetic default), written
    in the compressed-tensors layout, which the transformers engine reads."""
    from exportlm.quant import quantize

    model = quantize(build_model("llama", seed=0), "fp8")
    out = tmp_path_factory.mktemp("verify_quantized") / "ck"
    return exportlm.export_model("hf_checkpoint", model, out, format="compressed-tensors")


def test_a_quantized_checkpoint_of_ours_is_its_own_reference_without_calibrating(
    quantized: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --model: the checkpoint as exportlm's loader reads it (the stored scales) is the
    eager reference; nothing is calibrated or quantized again."""
    import exportlm.cli._calib as calib

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("verify calibrated again")

    monkeypatch.setattr(calib, "quantize_model", never)
    monkeypatch.delenv("EXPORTLM_ENGINE_TRANSFORMERS", raising=False)
    code = main(["verify", str(quantized), "--engine", "transformers", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert (row["layout"], row["scheme"]) == ("compressed-tensors", "FP8")
    assert code == 0, row
    assert (row["outcome"], row["tokens_equal"]) == ("passed", True)
    assert row["max_gap"] <= row["atol"]


def test_the_checkpoint_read_back_is_the_fake_quantized_model_as_a_reference(
    quantized: Path,
) -> None:
    """What verify compares with: the loaded runtime (no parameters of its own) gives the
    fake-quantized model's greedy tokens and logprobs (float32: within 1e-4)."""
    from exportlm.engines import choose_prompts, eager_reference
    from exportlm.quant import quantize

    fake = quantize(build_model("llama", seed=0), "fp8").eval()
    prompts = choose_prompts(fake)
    got = eager_reference(exportlm.load_exported("hf_checkpoint", quantized), prompts)
    want = eager_reference(fake, prompts)
    assert got.tokens == want.tokens
    gaps = [abs(a - b) for r, s in zip(got.logprobs, want.logprobs) for a, b in zip(r, s)]
    assert max(gaps) <= 1e-4


def test_a_quantized_checkpoint_without_a_manifest_needs_its_reference(
    quantized: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(quantized, copy)
    (copy / "exportlm-manifest.json").unlink()
    assert main(["verify", str(copy), "--engine", "transformers"]) == 2
    err = capsys.readouterr().err
    assert "has no exportlm manifest" in err
    assert "--model DIR --quantize RECIPE" in err


def test_a_changed_quantized_checkpoint_is_refused_before_it_is_read(
    quantized: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(quantized, copy)
    config = copy / "config.json"
    config.write_text(config.read_text() + "\n")
    assert main(["verify", str(copy), "--engine", "transformers"]) == 1
    assert "exportlm-manifest.json" in capsys.readouterr().err


def test_quantize_without_a_model_is_a_usage_error(
    quantized: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(quantized), "--engine", "transformers", "--quantize", "fp8"]) == 2
    assert "--quantize fp8: give the model to quantize with --model" in capsys.readouterr().err


def test_the_runtime_computes_a_bf16_checkpoint_in_the_dtype_asked(tmp_path: Path) -> None:
    """verify's reference of a bf16 checkpoint: its stored values, computed in float32."""
    import torch

    from exportlm.errors import InvalidInputError

    out = tmp_path / "bf16"
    exportlm.export_model("hf_checkpoint", build_model("llama", seed=0), out, dtype="bfloat16")
    ids = torch.tensor([[3, 4, 5]])
    assert exportlm.load_exported("hf_checkpoint", out)(ids).dtype == torch.bfloat16
    assert exportlm.load_exported("hf_checkpoint", out, dtype="float32")(ids).dtype == torch.float32
    with pytest.raises(InvalidInputError, match="not a torch floating-point dtype"):
        exportlm.load_exported("hf_checkpoint", out, dtype="int8")


def test_an_interpreter_that_is_not_one_is_named_by_the_option_given(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The message named the plugin's --export-engine, an option verify does not have."""
    args = ["verify", str(checkpoint), "--engine", "vllm", "--python", str(tmp_path / "nope")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"vllm: --python names '{tmp_path / 'nope'}', which is not an executable" in err
    assert "--export-engine" not in err
