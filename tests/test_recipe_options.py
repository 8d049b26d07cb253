"""Recipes take options: ``int4_awq:group_size=64`` and ``quantize(model, "int4_awq", group_size=64)``.

A real model with hidden size 576 (SmolLM2-135M) has input features no group of 128
divides; the toy here has hidden 192 (64 x 3, not a multiple of 128) for the same shape
problem at a toy's cost. The option reaches both checkpoint layouts' configs and reads back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import exportlm
from exportlm.errors import InvalidRecipeError, UnknownOptionError, UnsupportedFormatError
from exportlm.models import tiny_hf_model
from exportlm.quant import QuantRecipe, quantize

#: INT4 AWQ in compressed-tensors: the scales that cannot fold into a norm stay out.
CT_EXCLUDE = ["*o_proj", "*down_proj"]


def _toy() -> torch.nn.Module:
    return tiny_hf_model("llama", seed=0, hidden_size=192, intermediate_size=384).eval()


def _batch(model: Any) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (2, 8), generator=generator)


def test_group_size_128_refuses_hidden_192_naming_the_sizes_that_divide_it() -> None:
    model = _toy()
    with pytest.raises(UnsupportedFormatError) as caught:
        quantize(model, "int4_awq", calibrate=lambda m: m(_batch(m)))
    message = str(caught.value)
    assert "divisible by 128" in message
    assert "group_size=64 or group_size=32 divides 192" in message
    assert "--quantize int4_awq:group_size=64" in message
    assert not any(hasattr(m, "weight_quantizer") for m in model.modules())  # nothing converted


def test_unknown_options_and_values_are_refused_naming_the_known_ones() -> None:
    with pytest.raises(UnknownOptionError, match=r"'group_sze'.*accepted: clip, group_size"):
        quantize(_toy(), "int4_awq", group_sze=64)
    with pytest.raises(UnknownOptionError, match="accepted: clip, group_size"):
        QuantRecipe.parse("int4_awq:group_sze=64")
    with pytest.raises(UnknownOptionError, match=r"accepted: \(none\)"):
        QuantRecipe.parse("mxfp4:group_size=64")
    with pytest.raises(UnknownOptionError, match="accepted: scales"):
        QuantRecipe.parse("int8_wo:group_size=64")
    with pytest.raises(
        InvalidRecipeError, match=r"group_size=48 is not one it takes \(32 / 64 / 128\)"
    ):
        QuantRecipe.parse("int4_awq:group_size=48")
    with pytest.raises(InvalidRecipeError, match="alpha=2 is not in"):
        QuantRecipe.parse("int8_sq:alpha=2")
    with pytest.raises(InvalidRecipeError, match="KEY=VALUE"):
        QuantRecipe.parse("int4_awq:group_size")
    with pytest.raises(InvalidRecipeError, match=r"'fp8\+' has an empty part"):
        quantize(_toy(), "fp8+")  # was quantized as 'fp8'
    with pytest.raises(InvalidRecipeError, match="empty part"):
        QuantRecipe.parse("fp8++fp8_kv")
    with pytest.raises(InvalidRecipeError, match="names two weight algorithms"):
        QuantRecipe.parse("fp8+int8_wo")


def test_the_spelled_and_the_keyword_forms_are_one_recipe() -> None:
    spelled = QuantRecipe.parse("int4_awq:group_size=64+fp8_kv")
    keyword = QuantRecipe.parse("int4_awq+fp8_kv", options={"group_size": 64})
    assert spelled == keyword
    assert [a.weight_block for a in spelled.algorithms()] == [64]
    mixed = QuantRecipe.parse({"*": "fp8", "*.mlp.*": "int4_awq:group_size=32"})
    assert sorted(a.spelling for a in mixed.algorithms()) == ["fp8", "int4_awq:group_size=32"]


def test_smoothquant_alpha_option_changes_the_smoothing() -> None:
    scales = {}
    for alpha in (0.5, 1.0):
        model = _toy()
        quantize(model, "int8_sq", calibrate=lambda m: m(_batch(m)), alpha=alpha)
        q_proj = model.get_submodule("model.layers.0.self_attn.q_proj")
        assert q_proj.smoothquant_alpha == alpha
        scales[alpha] = q_proj.input_quantizer.pre_quant_scale
    assert not torch.allclose(scales[0.5], scales[1.0])


@pytest.mark.parametrize(
    ("layout", "exclude"), [("modelopt", None), ("compressed-tensors", CT_EXCLUDE)]
)
def test_group_size_64_is_written_in_each_layout_and_reads_back(
    tmp_path: Path, layout: str, exclude: list[str] | None
) -> None:
    model = _toy()
    batch = _batch(model)
    quantize(model, "int4_awq", calibrate=lambda m: m(batch), exclude=exclude, group_size=64)
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / layout, format=layout)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    if layout == "modelopt":
        declared = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert declared["quant_algo"] == "W4A16_AWQ"
        assert declared["group_size"] == 64
    else:
        assert config["config_groups"]["group_0"]["weights"]["group_size"] == 64
    runtime = exportlm.load_exported("hf_checkpoint", out)
    with torch.no_grad():
        expected = model(batch).logits.float()
        actual = torch.as_tensor(runtime(batch)).float()
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
