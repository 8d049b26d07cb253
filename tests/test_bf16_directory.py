"""A bfloat16 model directory, as hub checkpoints ship: exported and verified like with like.

``--verify`` compares the artifact with the eager model as the artifact computes it: the
directory is loaded with eager attention (as every exportlm runtime runs it), and a
``dtype`` option casts the reference as it cast the artifact. ONNX takes ``dtype`` so a
bfloat16 directory can become a graph onnxruntime's CPU kernels run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exportlm.cli import main
from exportlm.export._cast import cast_copy
from exportlm.models import build_model
from exportlm.quant import quantize


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama-bf16")
    model = build_model("llama", seed=0).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(directory)
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    return directory


def _export(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(["export", *argv, "--verify", "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if code == 0 else {"stdout": out}


def test_a_bf16_checkpoint_verifies_exactly(
    bf16_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = _export(
        capsys, "--target", "hf_checkpoint", "--model", str(bf16_dir), "--out", str(tmp_path / "c")
    )
    assert code == 0, result
    # the same bfloat16 weights through the same eager computation: no difference at all
    assert result["verify"]["max_abs"] == 0.0


def test_onnx_of_a_bf16_directory_takes_a_dtype(
    bf16_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.onnx"
    assert main(["export", "--target", "onnx", "--model", str(bf16_dir), "--out", str(out)]) == 1
    assert "-o dtype=fp32" in capsys.readouterr().err
    assert not out.exists()
    code, result = _export(
        capsys, "--target", "onnx", "--model", str(bf16_dir), "--out", str(out), "-o", "dtype=fp32"
    )
    assert code == 0, result
    assert result["verify"]["max_abs"] < 1e-4  # float32 graph vs the float32 cast model
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    assert manifest["options"]["dtype"] == "float32"


def test_cast_copy_leaves_the_model_and_quantized_tensors_alone() -> None:
    model = build_model("llama", seed=0, num_hidden_layers=1)
    quantize(model, "fp8")
    fp8 = {n: t.clone() for n, t in model.state_dict().items() if t.dtype == torch.float8_e4m3fn}
    before = {n: t.dtype for n, t in model.state_dict().items()}
    copied = cast_copy(model, torch.float16)
    assert copied is not model
    assert {n: t.dtype for n, t in model.state_dict().items()} == before
    state = copied.state_dict()
    for name, dtype in before.items():
        if dtype == torch.float32:
            assert state[name].dtype == torch.float16, name
    for name, tensor in fp8.items():  # bytes of quantized codes: exact, a pure copy
        assert torch.equal(state[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert cast_copy(copied, torch.float16) is copied  # nothing to cast: no copy
