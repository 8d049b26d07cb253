"""A quantization format defined in one FormatSpec, registered in this file, round-trips
through the ``hf_checkpoint`` target and runtime with no other code knowing about it.

The toy format: symmetric int6 codes stored in int8, one float32 scale per group of
32 input features (``weight_scale [out, in / 32]``), weight-only. Its stored dtype
and leaves are those of the built-in INT8 format, so the runtime can only read it
right by the ``quant_algo`` the checkpoint declares.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import exportlm
from exportlm.errors import UnsupportedFormatError
from exportlm.export import get_target_info, make_input_ids
from exportlm.models import tiny_hf_model
from exportlm.quant import (
    QUANT_FORMATS,
    FormatSpec,
    Leaf,
    QuantizedTensor,
    quantize,
    register_format,
    safe_scale,
)
from exportlm.quant.formats import CompressedTensorsScheme, ModelOptScheme, WeightRecipe

TARGET = "hf_checkpoint"
GROUP = 32
INT6_MAX = 31.0
QUANT_ALGO = "W6A16_G32"


def quantize_int6g(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    """Round ``x / (group_amax / 31)`` to int6 codes (in int8); ``scale`` is unused."""
    block = block_size or GROUP
    if x.shape[-1] % block:
        raise UnsupportedFormatError(f"{where}: int6g needs inputs divisible by {block}")
    groups = x.detach().to(torch.float32).reshape(*x.shape[:-1], -1, block)
    group_scale = safe_scale(groups.abs().amax(dim=-1), INT6_MAX, where=where)
    codes = (groups / group_scale.unsqueeze(-1)).round().clamp(-31, 31).to(torch.int8)
    return QuantizedTensor(
        "int6g", codes.reshape(x.shape), group_scale, None, block, tuple(x.shape), x.dtype
    )


def dequantize_int6g(q: QuantizedTensor) -> torch.Tensor:
    """Codes times their group's scale, float32."""
    block = q.block_size or GROUP
    groups = q.data.to(torch.float32).reshape(*q.shape[:-1], -1, block)
    return (groups * q.scale.unsqueeze(-1)).reshape(q.shape)


_CT_ARGS = {
    "num_bits": 6,
    "type": "int",
    "strategy": "group",
    "group_size": GROUP,
    "symmetric": True,
    "dynamic": False,
}

INT6G = FormatSpec(
    format="int6g",
    quantize=quantize_int6g,
    dequantize=dequantize_int6g,
    maxbound=INT6_MAX,
    amax_divisor=INT6_MAX,
    granularity="block",
    leaves=(
        Leaf("weight", torch.int8, source="data"),
        Leaf("weight_scale", torch.float32, source="scale"),
    ),
    recipe=WeightRecipe("int6g_wo", block_size=GROUP),
    modelopt=ModelOptScheme(QUANT_ALGO, weights={"dynamic": False, "num_bits": 6, "type": "int"}),
    compressed_tensors=CompressedTensorsScheme("int-quantized", weights=_CT_ARGS),
)


@pytest.fixture
def int6g() -> Iterator[FormatSpec]:
    register_format(INT6G)
    yield INT6G
    QUANT_FORMATS.unregister("int6g")


def _quantized(family: str, recipe: Any) -> tuple[Any, torch.Tensor]:
    model = tiny_hf_model(family, seed=0)
    ids = make_input_ids(model.config.vocab_size, 2, 8, seed=3)
    with torch.no_grad():
        quantize(model, recipe, calibrate=lambda m: m(ids))
    return model, ids


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return tensors


def _assert_runtime_reproduces(model: Any, ids: torch.Tensor, out: Path) -> None:
    """The runtime's logits are the fake-quantized model's, within the target's tolerance."""
    info = get_target_info(TARGET)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    got = exportlm.load_exported(TARGET, out)(ids)
    torch.testing.assert_close(got, expected, atol=info.atol, rtol=info.rtol)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_a_registered_format_round_trips_through_the_modelopt_checkpoint(
    int6g: FormatSpec, family: str, tmp_path: Path
) -> None:
    model, ids = _quantized(family, "int6g_wo")
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt")

    tensors = _tensors(out)
    proj = "model.layers.0.self_attn.o_proj"
    assert tensors[f"{proj}.weight"].dtype == torch.int8
    assert tensors[f"{proj}.weight_scale"].shape == (128, 128 // GROUP)
    assert int(tensors[f"{proj}.weight"].abs().max()) == 31
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert (quant["quant_algo"], quant["group_size"]) == (QUANT_ALGO, GROUP)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"] == {
        "dynamic": False,
        "num_bits": 6,
        "type": "int",
        "group_size": GROUP,
    }
    _assert_runtime_reproduces(model, ids, out)


def test_a_registered_format_mixes_with_a_built_in_one_in_one_checkpoint(
    int6g: FormatSpec, tmp_path: Path
) -> None:
    model, ids = _quantized("llama", {"*": "int8_wo", "*.mlp.*": "int6g_wo"})
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt")
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "MIXED_PRECISION"
    layers = quant["quantized_layers"]
    assert layers["model.layers.0.mlp.up_proj"]["quant_algo"] == QUANT_ALGO
    assert layers["model.layers.0.self_attn.q_proj"] == {"quant_algo": "W8A16"}
    # same stored dtype and leaves (int8 codes + weight_scale): only the declaration tells them apart
    _assert_runtime_reproduces(model, ids, out)


def test_a_registered_format_round_trips_through_compressed_tensors(
    int6g: FormatSpec, tmp_path: Path
) -> None:
    model, ids = _quantized("llama", "int6g_wo")
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt", format="compressed-tensors")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "int-quantized"
    assert config["config_groups"]["group_0"] == {
        "targets": ["Linear"],
        "weights": _CT_ARGS,
        "format": "int-quantized",
    }
    assert not (out / "hf_quant_config.json").exists()
    _assert_runtime_reproduces(model, ids, out)


def test_a_checkpoint_of_an_unregistered_format_is_refused_with_what_to_do(
    int6g: FormatSpec, tmp_path: Path
) -> None:
    model, _ = _quantized("llama", "int6g_wo")
    out = exportlm.export_model(TARGET, model, tmp_path / "ckpt")
    QUANT_FORMATS.unregister("int6g")
    try:
        with pytest.raises(UnsupportedFormatError, match=rf"'{QUANT_ALGO}'.*register"):
            exportlm.load_exported(TARGET, out)
    finally:
        register_format(INT6G)


def test_a_format_without_a_compressed_tensors_scheme_is_refused_by_that_layout(
    tmp_path: Path,
) -> None:
    from dataclasses import replace

    spec = replace(INT6G, compressed_tensors=None)
    register_format(spec)
    try:
        model, _ = _quantized("llama", "int6g_wo")
        with pytest.raises(UnsupportedFormatError, match="compressed-tensors"):
            exportlm.export_model(TARGET, model, tmp_path / "ckpt", format="compressed-tensors")
        assert not (tmp_path / "ckpt").exists()
    finally:
        QUANT_FORMATS.unregister("int6g")
