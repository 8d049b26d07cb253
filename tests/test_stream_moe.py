"""Streaming Mixtral and Qwen2/3-MoE: per-expert checkpoint tensors fused on load, as transformers does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from exportlm import load_exported
from exportlm.errors import MalformedCheckpointError, StreamingUnsupportedError
from exportlm.stream import export_streaming
from tests._stream_models import (
    assert_same_checkpoint,
    family_directory,
    in_memory_export,
    without_tensor,
)

SHARD = "100KB"  # several shards per model: the shard boundaries are compared too
#: one expert's tensor as transformers 5 saves it, per family
EXPERT_TENSOR = {
    "mixtral": "model.layers.1.block_sparse_moe.experts.2.w3.weight",
    "qwen2_moe": "model.layers.1.mlp.experts.2.up_proj.weight",
    "qwen3_moe": "model.layers.1.mlp.experts.2.down_proj.weight",
}


def _weight_map(directory: Path) -> dict[str, str]:
    index = directory / "model.safetensors.index.json"
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    return weight_map


@pytest.mark.parametrize(
    ("family", "recipe"),
    [
        ("mixtral", "fp8"),
        ("qwen2_moe", "fp8"),
        ("qwen3_moe", "fp8"),
        ("mixtral", "int4_awq"),
        ("mixtral", "int8_sq"),
        ("qwen2_moe", "nvfp4"),
        ("qwen2_moe", "int4_awq"),
        ("qwen3_moe", "fp8+fp8_kv"),
    ],
)
def test_per_expert_checkpoints_stream_byte_for_byte(
    tmp_path: Path, family: str, recipe: Any
) -> None:
    # in memory, layer 1 calibrates on the outputs of layer 0's quantized experts wrapper,
    # the stream on transformers' own: equal only because the wrapper, its quantizers
    # transparent, computes what transformers' experts do (for Mixtral: float32 routing
    # weights, each token's shares summed in float32 and rounded once, docs/streaming.md)
    src = family_directory(tmp_path, family)
    assert EXPERT_TENSOR[family] in _weight_map(src)  # saved one tensor per expert
    expected = in_memory_export(src, tmp_path / "memory", recipe, shard=SHARD)
    streamed = export_streaming(
        src, tmp_path / "streamed", recipe=recipe, max_shard_size=SHARD, calibration_inputs="float"
    )
    assert_same_checkpoint(expected, streamed)
    names = set(_weight_map(streamed))
    # written back per expert, under the checkpoint's own names, quantized
    stem = EXPERT_TENSOR[family].removesuffix(".weight")
    assert f"{stem}.weight_scale" in names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    assert any(n.endswith("k_scale") for n in names) == ("fp8_kv" in str(recipe))


def test_a_streamed_mixtral_loads_and_gives_finite_logits(tmp_path: Path) -> None:
    src = family_directory(tmp_path, "mixtral")
    streamed = export_streaming(src, tmp_path / "streamed", recipe="fp8", max_shard_size=SHARD)
    run = load_exported("hf_checkpoint", streamed)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = run(ids)
    assert logits.shape[:2] == (2, 7)
    assert torch.isfinite(logits).all()
    assert float(logits.float().std()) > 0  # not a zero model from unread experts


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_checkpoint_missing_one_experts_tensor_is_a_clear_error(
    tmp_path: Path, family: str
) -> None:
    src = family_directory(tmp_path, family)
    without_tensor(src, EXPERT_TENSOR[family])
    with pytest.raises(
        MalformedCheckpointError,
        match=rf"no shard holds tensor '{EXPERT_TENSOR[family]}' \(expert 2's \w+_proj of "
        r"model\.layers\.1\.mlp\.experts\.(gate_up|down)_proj\)",
    ):
        export_streaming(src, tmp_path / "out", recipe="fp8")
    assert not (tmp_path / "out").exists()


def test_a_family_with_another_name_conversion_is_still_refused(tmp_path: Path) -> None:
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    # GraniteMoe renames its fused experts on load (input_linear -> experts.gate_up_proj):
    # not a per-expert fusion, so it does not stream
    config = GraniteMoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
    )
    GraniteMoeForCausalLM(config).save_pretrained(tmp_path / "granite")
    with pytest.raises(
        StreamingUnsupportedError, match=r"converts its checkpoint's tensor names on load"
    ):
        export_streaming(tmp_path / "granite", tmp_path / "out", recipe="fp8")
    assert not (tmp_path / "out").exists()
