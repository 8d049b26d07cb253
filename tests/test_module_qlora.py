"""QLoRA exports: the summary and the quantization config name what was actually written."""

from __future__ import annotations

from exportlm.export.hf_checkpoint.configs import CheckpointQuantization
from exportlm.models import DecoderModel
from exportlm.module_exporters import DictSink, export_quantized_state, qlora_saved_name
from exportlm.quant import QuantLinear, quantize
from tests._lora import LoraLinear


def _qlora_decoder() -> DecoderModel:
    model = DecoderModel(num_layers=1)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    attn.q_proj = LoraLinear(attn.q_proj)
    mlp.up_proj = LoraLinear(mlp.up_proj)
    return model


def _prefixes(names: tuple[str, ...]) -> set[str]:
    return {name.rsplit(".", 1)[0] for name in names}


def test_qlora_summary_lists_only_the_names_written() -> None:
    model = quantize(_qlora_decoder(), {"*": "fp8", "*.mlp.up_proj.base_layer": "nvfp4"})
    assert isinstance(model.layers[0].mlp.up_proj.base_layer, QuantLinear)
    sink = DictSink()
    summary = export_quantized_state(model, sink, is_qlora=True)
    assert list(summary.tensor_names) == list(sink.tensors)
    assert not any("lora_" in n or "base_layer" in n for n in summary.tensor_names)
    assert "layers.0.mlp.up_proj.weight_scale_2" in sink.tensors  # NVFP4, under the base name
    section = CheckpointQuantization.of(summary).hf_quant_config()
    assert section["quant_algo"] == "MIXED_PRECISION"
    layers = section["quantized_layers"]
    assert layers["layers.0.self_attn.q_proj"]["quant_algo"] == "FP8"
    assert layers["layers.0.mlp.up_proj"]["quant_algo"] == "NVFP4"
    saved = _prefixes(summary.tensor_names)
    assert set(layers) <= saved  # every layer the config names is in the checkpoint
    assert set(summary.exclude_modules) <= saved
    assert not any("lora_" in n or "base_layer" in n for n in [*layers, *summary.exclude_modules])


def test_qlora_naming_rule() -> None:
    assert qlora_saved_name("model.q_proj.base_layer.weight") == "model.q_proj.weight"
    assert qlora_saved_name("model.q_proj.base_layer") == "model.q_proj"
    assert qlora_saved_name("model.q_proj.lora_A.default.weight") is None
    assert qlora_saved_name("model.q_proj.weight") == "model.q_proj.weight"
    name = "a.base_layer.b"
    assert qlora_saved_name(qlora_saved_name(name) or "") == qlora_saved_name(name)


def test_without_qlora_names_are_kept_as_they_are() -> None:
    model = quantize(_qlora_decoder(), "fp8")
    summary = export_quantized_state(model, DictSink())
    assert "layers.0.self_attn.q_proj.base_layer.weight" in summary.tensor_names
    assert "layers.0.self_attn.q_proj.lora_A.default.weight" in summary.tensor_names
