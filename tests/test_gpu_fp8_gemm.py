"""The FP8 GEMM comparison on the CPU, and the GPU check script's behaviour without CUDA.

``fp8_gemm`` runs ``torch._scaled_mm`` on CUDA only; the comparison it makes is
tested here with a checkpoint written by ``hf_checkpoint`` and read back from
disk, through both GEMMs (torch 2.13 also runs ``_scaled_mm`` on the CPU), so
only the CUDA kernel itself is left to ``benchmarks/gpu/check.sh``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exportlm.export import export_model
from exportlm.models import build_model
from exportlm.quant import quantize
from pytest_exportcheck.checks.exporters.fp8_gemm import (
    GEMM_TOKENS,
    compare_fp8_linear,
    fp8_linear_prefixes,
    reference_gemm,
    scaled_mm_gemm,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "check.sh"


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, dict]:
    """An FP8 Llama toy model (calibrated) and the tensors its checkpoint holds on disk."""
    model = quantize(build_model("llama", seed=0), "fp8")
    out = export_model("hf_checkpoint", model, tmp_path_factory.mktemp("fp8") / "ckpt")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return model, tensors


def _modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return dict(model.named_modules())


def test_every_quantized_linear_of_the_checkpoint_is_found(fp8_checkpoint: tuple) -> None:
    _model, tensors = fp8_checkpoint
    prefixes = fp8_linear_prefixes(tensors)
    assert "model.layers.0.self_attn.q_proj" in prefixes
    assert "lm_head" not in prefixes  # excluded: no FP8 weight
    assert all(tensors[f"{p}.weight"].dtype == torch.float8_e4m3fn for p in prefixes)


@pytest.mark.parametrize("gemm", [reference_gemm, scaled_mm_gemm], ids=["reference", "scaled_mm"])
def test_the_exported_linears_match_the_fake_quant_forward(fp8_checkpoint: tuple, gemm) -> None:
    model, tensors = fp8_checkpoint
    modules = _modules(model)
    results = [
        compare_fp8_linear(modules[p], tensors, p, gemm) for p in fp8_linear_prefixes(tensors)
    ]
    assert len(results) >= 7
    failed = [r.summary() for r in results if not r.passed]
    assert not failed, failed
    assert all(r.shape[0] == GEMM_TOKENS for r in results)


@pytest.mark.parametrize("leaf", ["weight_scale", "input_scale"])
@pytest.mark.parametrize("gemm", [reference_gemm, scaled_mm_gemm], ids=["reference", "scaled_mm"])
def test_a_scale_off_by_two_percent_fails(fp8_checkpoint: tuple, leaf: str, gemm) -> None:
    model, tensors = fp8_checkpoint
    prefix = "model.layers.0.mlp.down_proj"
    corrupted = {**tensors, f"{prefix}.{leaf}": tensors[f"{prefix}.{leaf}"] * 1.02}
    result = compare_fp8_linear(_modules(model)[prefix], corrupted, prefix, gemm)
    assert not result.passed
    assert result.mismatched > 0
    assert result.max_ratio > 1
    assert prefix in result.summary()
    assert "beyond" in result.summary()


def test_a_transposed_weight_fails(fp8_checkpoint: tuple) -> None:
    model, tensors = fp8_checkpoint
    prefix = "model.layers.0.self_attn.o_proj"  # square, so the transpose has the right shape
    weight = tensors[f"{prefix}.weight"]
    corrupted = {**tensors, f"{prefix}.weight": weight.t().contiguous()}
    assert not compare_fp8_linear(_modules(model)[prefix], corrupted, prefix).passed


def test_a_weight_that_is_not_fp8_is_refused_with_what_was_expected(fp8_checkpoint: tuple) -> None:
    model, tensors = fp8_checkpoint
    prefix = "model.layers.0.self_attn.q_proj"
    wrong = {**tensors, f"{prefix}.weight": tensors[f"{prefix}.weight"].to(torch.float32)}
    with pytest.raises(ValueError, match=r"float8_e4m3fn \[out_features, in_features\]"):
        compare_fp8_linear(_modules(model)[prefix], wrong, prefix)


# ----------------------------------------------------------------------------- the script


def _script(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **env},
    )


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU build of torch")
def test_the_script_stops_with_exit_2_on_a_cpu_build_of_torch(tmp_path: Path) -> None:
    done = _script(PYTHON=sys.executable, OUT=str(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "this torch is a CPU build (torch.version.cuda is None): install a CUDA torch" in (
        done.stderr
    )
    assert "PYTHON=" in done.stderr
    assert f"torch {torch.__version__}, built for CUDA None" in done.stdout
    assert not (tmp_path / "report.json").exists()  # pytest never started


def test_the_script_names_a_python_that_does_not_exist(tmp_path: Path) -> None:
    done = _script(PYTHON=str(tmp_path / "no-python"), OUT=str(tmp_path))
    assert done.returncode == 2
    assert "is not an executable python; set PYTHON=" in done.stderr


def test_the_checkout_is_made_importable_without_installing(tmp_path: Path) -> None:
    # As in a python where exportlm is not installed: its distribution is not found.
    script = ROOT / "benchmarks" / "gpu" / "checkout.py"
    code = (
        "import importlib.metadata as m, runpy, sys\n"
        "def missing(name): raise m.PackageNotFoundError(name)\n"
        "m.distribution = missing\n"
        f"sys.argv = [{str(script)!r}, {str(ROOT)!r}, {str(tmp_path)!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{ROOT / 'src'}:{ROOT}:{tmp_path}"
    (info,) = tmp_path.glob("exportlm-*.dist-info")
    entry_points = (info / "entry_points.txt").read_text()
    assert "[pytest11]\nexportcheck = pytest_exportcheck.plugin" in entry_points


def test_the_summary_counts_outcomes_per_check(tmp_path: Path) -> None:
    report = {
        "environment": {"torch": "2.13", "cuda": "CUDA available (1x H200)", "float32": "TF32 off"},
        "items": [
            {
                "id": "fp8_gemm[quant_linear-cuda]",
                "check": "fp8_gemm",
                "outcome": "pass",
                "duration": 2.0,
            },
            {
                "id": "roundtrip_logits[onnx-llama-cuda]",
                "check": "roundtrip_logits",
                "outcome": "skip",
                "message": "capability gap",
                "duration": 0.0,
            },
            {
                "id": "roundtrip_logits[torch_export-llama-cuda]",
                "check": "roundtrip_logits",
                "outcome": "fail",
                "message": "logits differ\nmore",
                "duration": 1.0,
            },
        ],
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "summary.py"), str(path), "42"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.split() == ["roundtrip_logits", "0", "1", "0", "1"] for line in lines), lines
    assert "FAILED roundtrip_logits[torch_export-llama-cuda]: logits differ" in lines
    assert "skipped 1x: capability gap" in lines
    assert "wall time: 42s" in lines
