"""Support-table rows limited to some checkpoint model types.

transformers 5.19.0 loads our compressed-tensors FP8 checkpoint of the toy Llama right,
but of the toy qwen3_moe it drops the experts' ``input_scale`` (reported UNEXPECTED) and
merges their FP8 weights into 3-D bfloat16 parameters: its table says ``misreads`` for
that model type only, and the ``served`` item reports the declared limit. The last test
runs the engine (``make test-engines``); the others need none.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

import exportlm
from exportlm.engines import (
    Outcome,
    Support,
    Verdict,
    artifact_kind,
    find_interpreter,
    get_engine,
    serve_and_compare,
)
from exportlm.models import build_model
from exportlm.quant import quantize

_CT_FP8 = ("hf_checkpoint", "compressed-tensors", "FP8")


def _fp8(family: str) -> torch.nn.Module:
    model = build_model(family, seed=0).eval()
    quantize(model, "fp8")
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Our compressed-tensors FP8 checkpoint of each family, exported once."""
    root = tmp_path_factory.mktemp("ct-fp8")
    return {
        family: exportlm.export_model(
            "hf_checkpoint", _fp8(family), root / family, format="compressed-tensors"
        )
        for family in ("llama", "qwen3_moe")
    }


def test_a_checkpoints_kind_carries_its_model_type(checkpoints: dict[str, Path]) -> None:
    for family, path in checkpoints.items():
        kind = artifact_kind(path)
        assert (kind.target, kind.layout, kind.scheme, kind.model_type) == (*_CT_FP8, family)


def test_transformers_misreads_ct_fp8_of_qwen3_moe_only(checkpoints: dict[str, Path]) -> None:
    transformers = get_engine("transformers")
    verdicts = {}
    for family, path in checkpoints.items():
        kind = artifact_kind(path)
        match = transformers.support(*_CT_FP8, dtype="float32", model_type=kind.model_type)
        verdicts[family] = match.verdict
        if match.verdict is Verdict.MISREADS:
            assert "input_scale" in match.reason
            assert "model_type=qwen3_moe" in match.reason
    assert verdicts == {"llama": Verdict.RUNS, "qwen3_moe": Verdict.MISREADS}
    # no model type given (a caller that does not read config.json): the general row
    assert transformers.support(*_CT_FP8).verdict is Verdict.RUNS


def test_a_row_limited_to_model_types_matches_no_other() -> None:
    row = Support(*_CT_FP8, model_types=("qwen3_moe",))
    assert row.matches(*_CT_FP8, "float32", "qwen3_moe")
    assert not row.matches(*_CT_FP8, "float32", "llama")
    assert not row.matches(*_CT_FP8, "float32")
    assert Support(*_CT_FP8).matches(*_CT_FP8, "float32", "llama")


@pytest.mark.engines
def test_transformers_misreads_our_qwen3_moe_ct_fp8_as_its_table_says(
    checkpoints: dict[str, Path],
) -> None:
    found = find_interpreter("transformers")
    if found.path is None:
        pytest.skip(f"{found.reason}. Run `make engines` (or `make test-engines`)")
    probe = subprocess.run([str(found.path), "-E", "-s", "-c", "import compressed_tensors"])
    if probe.returncode != 0:
        pytest.skip(f"compressed_tensors does not import in {found.path}: run `make engines`")
    got = serve_and_compare("transformers", checkpoints["qwen3_moe"], _fp8("qwen3_moe"))
    if got.off_table:
        pytest.skip(
            f"transformers {got.engine_version}: its table was read from {got.table_version}"
        )
    assert got.outcome is Outcome.MISREADS, got.message
    assert got.max_gap is not None
    # measured 0.0095 (served check prompts); far above float32 rounding (1e-4)
    assert got.max_gap > 1e-3, f"transformers now reads the experts' input_scale: {got}"
