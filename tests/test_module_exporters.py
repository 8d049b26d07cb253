"""export_quantized_state and the built-in exporters: layouts, bit-exactness, ties, errors."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from exportlm.errors import TiedWeightsError, UnclaimedModuleError
from exportlm.export import make_input_ids
from exportlm.export.hf_checkpoint.configs import CheckpointQuantization
from exportlm.models import DecoderModel, IterableMoEModel, tiny_hf_model
from exportlm.module_exporters import (
    DictSink,
    ExportContext,
    ExportModuleRegistry,
    LayerFacts,
    ModuleExporter,
    QuantExportSummary,
    QuantLinearExporter,
    export_quantized_state,
)
from exportlm.quant import QuantExperts, QuantLinear, get_format, quantize
from tests._lora import LoraLinear


def _export(model: nn.Module, **kwargs: object) -> tuple[dict[str, torch.Tensor], object]:
    sink = DictSink()
    summary = export_quantized_state(model, sink, **kwargs)  # type: ignore[arg-type]
    return sink.tensors, summary


def _section(summary: object) -> dict[str, object]:
    """``hf_quant_config.json``'s section, from the checkpoint writer's builder."""
    assert isinstance(summary, QuantExportSummary)
    return CheckpointQuantization.of(summary).hf_quant_config()


def _state_bytes(model: nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, buffer)
    return buffer.getvalue()


def _fp8_dequant(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return tensors[f"{prefix}.weight"].to(torch.float32) * tensors[f"{prefix}.weight_scale"]


@pytest.mark.parametrize("family", ["llama", "mixtral", "gpt_oss"])
def test_fp8_fake_quant_weights_equal_dequantized_export_bit_for_bit(family: str) -> None:
    model = quantize(tiny_hf_model(family, 0, num_hidden_layers=1), "fp8")
    tensors, summary = _export(model)
    checked = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, QuantLinear):
                fake = module.weight_quantizer(module.effective_weight())
                assert torch.equal(fake, _fp8_dequant(tensors, name)), name
                checked += 1
            elif isinstance(module, QuantExperts):
                gate_up = module.gate_up_proj_weight_quantizer(
                    module.canonical_weight("gate_up_proj")
                )
                down = module.down_proj_weight_quantizer(module.canonical_weight("down_proj"))
                for e in range(module.num_experts):
                    gate, up = module.split_gate_up(gate_up[e], dim=-2)
                    for proj, fake in (
                        ("gate_proj", gate),
                        ("up_proj", up),
                        ("down_proj", down[e]),
                    ):
                        assert torch.equal(fake, _fp8_dequant(tensors, f"{name}.{e}.{proj}"))
                        checked += 1
    assert checked >= 7
    assert _section(summary)["quant_algo"] == "FP8"


def test_fp8_layout_matches_modelopt() -> None:
    tensors, summary = _export(quantize(DecoderModel(num_layers=1), "fp8+fp8_kv"))
    prefix = "layers.0.self_attn.k_proj"
    assert tensors[f"{prefix}.weight"].dtype == torch.float8_e4m3fn
    assert tensors[f"{prefix}.weight"].shape == (128, 128)
    for scale in ("weight_scale", "input_scale", "k_scale"):
        assert tensors[f"{prefix}.{scale}"].dtype == torch.float32
        assert tensors[f"{prefix}.{scale}"].dim() == 0
    assert "layers.0.self_attn.v_proj.v_scale" in tensors
    assert tensors["lm_head.weight"].dtype == torch.float32
    config = _section(summary)
    assert config == {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8",
        "exclude_modules": ["embed_tokens", "lm_head"],
    }


@pytest.mark.parametrize(
    ("recipe", "weight_dtype", "weight_shape", "extra"),
    [
        (
            "nvfp4",
            torch.uint8,
            (256, 64),
            {
                "weight_scale": ((256, 8), torch.float8_e4m3fn),
                "weight_scale_2": ((), torch.float32),
            },
        ),
        (
            "int4_awq",
            torch.uint8,
            (128, 128),
            # up_proj's AWQ scale is folded into the norm before the MLP (no pre_quant_scale)
            {"weight_scale": ((256, 1), torch.float32)},
        ),
        ("int8_wo", torch.int8, (256, 128), {"weight_scale": ((256,), torch.float32)}),
    ],
)
def test_other_formats_layouts(
    recipe: str,
    weight_dtype: torch.dtype,
    weight_shape: tuple[int, ...],
    extra: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> None:
    tensors, summary = _export(quantize(DecoderModel(num_layers=1), recipe))
    prefix = "layers.0.mlp.up_proj"  # [256 out, 128 in]
    assert tensors[f"{prefix}.weight"].dtype == weight_dtype
    assert tuple(tensors[f"{prefix}.weight"].shape) == weight_shape
    for suffix, (shape, dtype) in extra.items():
        assert tuple(tensors[f"{prefix}.{suffix}"].shape) == shape, suffix
        assert tensors[f"{prefix}.{suffix}"].dtype == dtype, suffix
    if recipe == "int4_awq":  # no norm before down_proj: its scale stays pre_quant_scale
        assert f"{prefix}.pre_quant_scale" not in tensors
        assert tensors["layers.0.mlp.down_proj.pre_quant_scale"].shape == (256,)
    config = _section(summary)
    assert (
        config["quant_algo"]
        == {"nvfp4": "NVFP4", "int4_awq": "W4A16_AWQ", "int8_wo": "W8A16"}[recipe]
    )


def test_mixed_precision_summary_lists_quantized_layers() -> None:
    model = quantize(DecoderModel(num_layers=1), {"*": "fp8", "*.mlp.*": "nvfp4"})
    _, summary = _export(model)
    assert isinstance(summary, QuantExportSummary)
    # the exporters record neutral facts: the format's spec and the group size
    assert summary.quantized_layers["layers.0.self_attn.q_proj"] == LayerFacts(get_format("fp8"))
    assert summary.quantized_layers["layers.0.mlp.down_proj"] == LayerFacts(get_format("nvfp4"), 16)
    assert len(summary.layer_formats) == 2
    config = _section(summary)
    assert config["quant_algo"] == "MIXED_PRECISION"
    layers = config["quantized_layers"]
    assert isinstance(layers, dict)
    assert layers["layers.0.self_attn.q_proj"] == {"quant_algo": "FP8"}
    assert layers["layers.0.mlp.down_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    # as ModelOpt 0.47 writes MIXED_PRECISION: a layer not listed is unquantized
    assert "exclude_modules" not in config


def test_export_does_not_modify_the_model() -> None:
    model = quantize(tiny_hf_model("mixtral", 0, num_hidden_layers=1), "fp8+fp8_kv")
    before_types = [type(m) for m in model.modules()]
    before = _state_bytes(model)
    _export(model, dtype=torch.bfloat16)
    assert [type(m) for m in model.modules()] == before_types
    assert _state_bytes(model) == before


def test_fused_experts_share_input_scale_and_gate_up_weight_scale() -> None:
    model = quantize(tiny_hf_model("qwen3_moe", 0, num_hidden_layers=1), "fp8")
    tensors, summary = _export(model)
    prefix = "model.layers.0.mlp.experts"
    inputs = {float(tensors[f"{prefix}.{e}.gate_proj.input_scale"]) for e in range(4)}
    inputs |= {float(tensors[f"{prefix}.{e}.up_proj.input_scale"]) for e in range(4)}
    assert len(inputs) == 1
    for e in range(4):
        assert torch.equal(
            tensors[f"{prefix}.{e}.gate_proj.weight_scale"],
            tensors[f"{prefix}.{e}.up_proj.weight_scale"],
        )
    slice_ = summary.canonical_modules[f"{prefix}.2.up_proj"]  # type: ignore[attr-defined]
    assert (slice_.module, slice_.expert, slice_.projection) == (prefix, 2, "up_proj")
    assert "model.layers.0.mlp.gate" in summary.exclude_modules  # type: ignore[attr-defined]


def test_bmm_experts_split_interleaved_gate_up_with_biases() -> None:
    model = quantize(tiny_hf_model("gpt_oss", 0, num_hidden_layers=1), "fp8")
    tensors, _ = _export(model)
    experts = model.model.layers[0].mlp.experts
    prefix = "model.layers.0.mlp.experts.1"
    assert torch.equal(tensors[f"{prefix}.gate_proj.bias"], experts.gate_up_proj_bias[1, 0::2])
    assert torch.equal(tensors[f"{prefix}.up_proj.bias"], experts.gate_up_proj_bias[1, 1::2])
    assert torch.equal(tensors[f"{prefix}.down_proj.bias"], experts.down_proj_bias[1])
    assert tensors[f"{prefix}.gate_proj.weight"].shape == (128, 128)  # [I, H]
    assert tensors[f"{prefix}.down_proj.weight"].shape == (128, 128)  # [H, I]
    gate_rows = experts.gate_up_proj[1].T[0::2]
    assert torch.allclose(
        _fp8_dequant(tensors, f"{prefix}.gate_proj"), gate_rows, rtol=0.07, atol=1e-3
    )


def test_iterable_experts_share_one_input_scale_per_projection() -> None:
    tensors, summary = _export(quantize(IterableMoEModel(num_layers=1), "fp8"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        scales = {float(tensors[f"layers.0.mlp.experts.{e}.{proj}.input_scale"]) for e in range(4)}
        assert len(scales) == 1, proj
    for e in range(4):
        assert torch.equal(
            tensors[f"layers.0.mlp.experts.{e}.gate_proj.weight_scale"],
            tensors[f"layers.0.mlp.experts.{e}.up_proj.weight_scale"],
        )
    assert "layers.0.mlp.gate" in summary.exclude_modules  # type: ignore[attr-defined]


def test_unclaimed_quantized_module_names_path_class_and_exporters() -> None:
    model = quantize(DecoderModel(num_layers=1), "fp8")
    registry = ExportModuleRegistry()
    registry.register(QuantLinearExporter(), "SomethingElse")
    with pytest.raises(UnclaimedModuleError) as info:
        export_quantized_state(model, DictSink(), registry=registry)
    message = str(info.value)
    assert "'layers.0.self_attn.q_proj'" in message
    assert "exportlm.quant._modules.QuantLinear" in message
    assert "quant_linear [SomethingElse]" in message


def test_a_third_party_exporter_takes_over_with_prepend() -> None:
    class Marker(ModuleExporter):
        name = "marker"

        def export(self, name: str, module: nn.Module, ctx: ExportContext) -> None:
            ctx.emit(f"{name}.marker", torch.zeros(()))

    from exportlm.module_exporters import register_builtin_module_exporters

    registry = ExportModuleRegistry()
    register_builtin_module_exporters(registry)
    registry.register(Marker(), QuantLinear, prepend=True)
    tensors, _ = _export(quantize(DecoderModel(num_layers=1), "fp8"), registry=registry)
    assert "layers.0.self_attn.q_proj.marker" in tensors
    assert "layers.0.self_attn.q_proj.weight" not in tensors


@pytest.mark.parametrize(
    "model_fn",
    [
        lambda: tiny_hf_model("llama_tied", 0, num_hidden_layers=1),
        lambda: DecoderModel(num_layers=1, tie_embeddings=True),
    ],
)
def test_tied_weights_written_once_under_the_source_name(model_fn: object) -> None:
    model = quantize(model_fn(), "fp8")  # type: ignore[operator]
    tensors, _ = _export(model)
    assert "lm_head.weight" not in tensors
    embed = (
        "model.embed_tokens.weight"
        if "model.embed_tokens.weight" in tensors
        else "embed_tokens.weight"
    )
    assert torch.equal(tensors[embed], model.get_submodule(embed.rsplit(".", 1)[0]).weight)


def test_declared_ties_that_differ_raise() -> None:
    model = DecoderModel(num_layers=1, tie_embeddings=True)
    model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach() + 1.0)
    with pytest.raises(
        TiedWeightsError, match=r"'lm_head.weight' is declared tied to 'embed_tokens.weight'"
    ):
        _export(model)


def test_untied_model_with_a_declaration_keeps_both_tensors() -> None:
    model = tiny_hf_model("llama", 0, num_hidden_layers=1)  # declares the tie, config unties it
    tensors, _ = _export(model)
    assert "lm_head.weight" in tensors
    assert "model.embed_tokens.weight" in tensors


def test_distinct_tensors_sharing_an_address_are_all_written() -> None:
    storage = torch.randn(8)
    model = nn.Module()
    model.a = nn.Parameter(storage[:4])  # same data_ptr ...
    model.b = nn.Parameter(storage.view(2, 4))  # ... different tensor, shape and values
    assert model.a.data_ptr() == model.b.data_ptr()
    tensors, _ = _export(model)
    assert set(tensors) == {"a", "b"}
    assert tensors["b"].shape == (2, 4)


def test_shared_parameter_object_is_written_once() -> None:
    model = nn.Module()
    model.first = nn.Linear(4, 4, bias=False)
    model.second = nn.Linear(4, 4, bias=False)
    model.second.weight = model.first.weight
    tensors, _ = _export(model)
    assert list(tensors) == ["first.weight"]


def test_qlora_drops_adapters_and_rewrites_base_layer_names() -> None:
    model = DecoderModel(num_layers=1)
    attn = model.layers[0].self_attn
    attn.q_proj = LoraLinear(attn.q_proj)
    quantize(model, "fp8")
    assert isinstance(attn.q_proj.base_layer, QuantLinear)
    assert not isinstance(attn.q_proj.lora_A["default"], QuantLinear)  # adapters excluded
    tensors, summary = _export(model, is_qlora=True)
    assert not any("lora_" in n or "base_layer" in n for n in tensors)
    assert tensors["layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert "layers.0.self_attn.q_proj.input_scale" in tensors
    assert not any("lora" in n for n in summary.exclude_modules)  # type: ignore[attr-defined]


def test_dtype_applies_to_unquantized_tensors_only() -> None:
    tensors, _ = _export(quantize(DecoderModel(num_layers=1), "fp8"), dtype=torch.bfloat16)
    assert tensors["embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["layers.0.self_attn.q_proj.weight_scale"].dtype == torch.float32


def test_compressed_tensors_format_writes_fp8_with_1d_scales_and_nvfp4_in_its_names() -> None:
    tensors, _ = _export(quantize(DecoderModel(num_layers=1), "fp8"), format="compressed-tensors")
    assert tensors["layers.0.mlp.up_proj.weight_scale"].shape == (1,)
    assert tensors["layers.0.mlp.up_proj.input_scale"].shape == (1,)
    tensors, _ = _export(quantize(DecoderModel(num_layers=1), "nvfp4"), format="compressed-tensors")
    assert {n.rpartition(".")[2] for n in tensors if n.startswith("layers.0.mlp.up_proj.")} == {
        "weight_packed",
        "weight_scale",
        "weight_global_scale",
        "input_global_scale",
    }


def test_unquantized_model_exports_its_state_dict() -> None:
    model = DecoderModel(num_layers=1)
    tensors, summary = _export(model)
    assert tensors.keys() == model.state_dict().keys()
    assert _section(summary)["quant_algo"] is None
    assert summary.quantized_layers == {}  # type: ignore[attr-defined]
    assert "lm_head" in summary.exclude_modules  # type: ignore[attr-defined]


def test_reloaded_fp8_checkpoint_reproduces_fake_quant_weights() -> None:
    model = quantize(DecoderModel(num_layers=1), "fp8")
    tensors, _ = _export(model)
    ids = make_input_ids(model.config.vocab_size)
    plain = DecoderModel(num_layers=1)
    state = {k: v for k, v in tensors.items() if not k.endswith(("_scale",))}
    for key in list(state):
        if state[key].dtype == torch.float8_e4m3fn:
            state[key] = _fp8_dequant(tensors, key.rsplit(".", 1)[0])
    plain.load_state_dict(state)
    for module in model.modules():  # compare weights only: switch activation quantizers off
        if isinstance(module, QuantLinear):
            module.input_quantizer.enabled = False
    with torch.no_grad():  # same process, same kernels, bit-identical weights: exact
        assert torch.equal(model(ids), plain(ids))
