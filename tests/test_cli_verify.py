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
