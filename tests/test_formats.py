"""Quantization formats as data: the built-in specs describe what is written, and a
format defined in one FormatSpec round-trips through quantize, the exporters and dequantize."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from exportlm.errors import (
    QuantizationError,
    RegistryConflictError,
    UnknownNameError,
    UnsupportedFormatError,
)
from exportlm.export import make_input_ids
from exportlm.export.hf_checkpoint.configs import CheckpointQuantization
from exportlm.models import DecoderModel
from exportlm.module_exporters import DictSink, LayerFacts, export_quantized_state
from exportlm.quant import (
    QUANT_FORMATS,
    FormatSpec,
    Leaf,
    QuantFormat,
    QuantizedTensor,
    QuantLinear,
    TensorQuantizer,
    dequantize,
    get_format,
    quantize,
    quantize_tensor,
    recipe_names,
    register_format,
    safe_scale,
    scale_leaf_names,
)
from exportlm.quant.formats import (
    ModelOptScheme,
    WeightRecipe,
    activation_leaf_names,
    format_for_quant_algo,
)

# -- a toy format, defined in one spec: symmetric int6 codes (in int8), one scale per row --
INT6_MAX = 31.0


def quantize_int6(
    x: torch.Tensor, *, scale: torch.Tensor | None, block_size: int | None, where: str
) -> QuantizedTensor:
    x32 = x.detach().to(torch.float32)
    row_scale = safe_scale(x32.abs().amax(dim=-1), INT6_MAX, where=where)
    codes = (x32 / row_scale.unsqueeze(-1)).round().clamp(-31, 31).to(torch.int8)
    return QuantizedTensor("int6", codes, row_scale, shape=tuple(x.shape), dtype=x.dtype)


def dequantize_int6(q: QuantizedTensor) -> torch.Tensor:
    return q.data.to(torch.float32) * q.scale.unsqueeze(-1)


INT6 = FormatSpec(
    format="int6",
    quantize=quantize_int6,
    dequantize=dequantize_int6,
    maxbound=INT6_MAX,
    amax_divisor=INT6_MAX,
    granularity="row",
    leaves=(
        Leaf("weight", torch.int8, source="data"),
        Leaf("weight_scale", torch.float32, source="scale"),
    ),
    recipe=WeightRecipe("int6_wo", axis=0),
    modelopt=ModelOptScheme("W6A16", weights={"dynamic": False, "num_bits": 6, "type": "int"}),
)


@pytest.fixture
def int6() -> Iterator[FormatSpec]:
    assert register_format(INT6) is INT6
    yield INT6
    QUANT_FORMATS.unregister("int6")


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    logits = out[0] if isinstance(out, tuple) else out
    assert isinstance(logits, torch.Tensor)
    return logits


def _leaves(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {
        name.removeprefix(f"{prefix}."): t
        for name, t in tensors.items()
        if name.rsplit(".", 1)[0] == prefix
    }


# -- the toy format --------------------------------------------------------------------------
def test_a_registered_format_quantizes_a_tensor_and_dequantizes_it(int6: FormatSpec) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    q = quantize_tensor(x, "int6")
    assert (q.format, q.data.dtype, q.data.shape, q.scale.shape) == (
        "int6",
        torch.int8,
        (8, 32),
        (8,),
    )
    assert int(q.data.abs().max()) == 31
    back = dequantize(q)
    # rounding to the nearest code: off by at most half a step per row
    assert bool(((back - x).abs() <= q.scale.unsqueeze(-1) / 2 + 1e-7).all())
    assert get_format("int6") is int6
    assert "int6_wo" in recipe_names()


def test_a_registered_format_round_trips_through_quantize_export_and_dequantize(
    int6: FormatSpec,
) -> None:
    model = DecoderModel(num_layers=1)
    ids = make_input_ids(model.config.vocab_size)
    with torch.no_grad():
        reference = _logits(model, ids)
        quantize(model, "int6_wo")
        out = _logits(model, ids)
    # A forward pass: within a tolerance. int8_wo measures 6.6e-4 on this model (see
    # tests/test_quant.py); int6 has 4x coarser steps, and 0 would mean nothing was quantized.
    rel = float((out - reference).norm() / reference.norm())
    assert 1e-5 < rel < 2e-2
    sink = DictSink()
    summary = export_quantized_state(model, sink)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert linears
    for name, module in linears.items():
        assert module.weight_quantizer.format == "int6"
        leaves = _leaves(sink.tensors, name)
        assert {k: v.dtype for k, v in leaves.items()} == {
            "weight": torch.int8,
            "weight_scale": torch.float32,
        }
        with torch.no_grad():
            fake = module.weight_quantizer(module.effective_weight())
        # Exact on purpose: the fake-quantized weight and the dequantized export are the
        # same elementwise ops on the same tensor (no matmul, no order-dependent reduction).
        assert torch.equal(dequantize(int6.from_leaves(leaves)), fake), name
    assert summary.layer_formats == (LayerFacts(int6),)
    assert CheckpointQuantization.of(summary).hf_quant_config()["quant_algo"] == "W6A16"


def test_a_registered_format_mixes_with_the_built_in_ones(int6: FormatSpec) -> None:
    model = quantize(DecoderModel(num_layers=1), {"*": "fp8", "*.mlp.*": "int6_wo"})
    sink = DictSink()
    summary = export_quantized_state(model, sink)
    layers = CheckpointQuantization.of(summary).hf_quant_config()["quantized_layers"]
    assert layers["layers.0.mlp.down_proj"] == {"quant_algo": "W6A16"}
    assert layers["layers.0.self_attn.q_proj"] == {"quant_algo": "FP8"}
    assert sink.tensors["layers.0.mlp.down_proj.weight"].dtype == torch.int8
    assert sink.tensors["layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn


def test_a_weight_only_format_refuses_what_it_cannot_do(int6: FormatSpec) -> None:
    model = quantize(DecoderModel(num_layers=1), "int6_wo")
    with pytest.raises(UnsupportedFormatError, match=r"writes FP8 / .* only.*int6"):
        export_quantized_state(model, DictSink(), format="compressed-tensors")
    quantizer = TensorQuantizer("int6", enabled=False, label="m.input_quantizer")
    with pytest.raises(
        QuantizationError, match="static activation scales are FP8 or INT8_TENSOR or NVFP4"
    ):
        quantizer.load_scale(torch.tensor(1.0), "int6")


def test_config_fields_of_a_registered_format(int6: FormatSpec) -> None:
    assert format_for_quant_algo("W6A16") is int6
    assert int6.modelopt_layer_config(None) == {"quant_algo": "W6A16"}
    assert int6.modelopt_group(None) == {
        "weights": {"dynamic": False, "num_bits": 6, "type": "int"}
    }


def test_an_unregistered_format_is_gone_everywhere() -> None:
    register_format(INT6)
    QUANT_FORMATS.unregister("int6")
    assert "int6_wo" not in recipe_names()
    with pytest.raises(
        UnknownNameError,
        match=r"'int6'.*available: fp8, fp8_block, fp8_dynamic, fp8_group, int4, int8, .*nvfp4",
    ):
        TensorQuantizer("int6")
    with pytest.raises(UnknownNameError, match=r"'int6_wo'"):
        quantize(DecoderModel(num_layers=1), "int6_wo")


# -- registration rules --------------------------------------------------------------------
def _variant(**changes: object) -> FormatSpec:
    fields = {
        "format": INT6.format,
        "quantize": INT6.quantize,
        "dequantize": INT6.dequantize,
        "maxbound": INT6.maxbound,
        "amax_divisor": INT6.amax_divisor,
        "granularity": INT6.granularity,
        "leaves": INT6.leaves,
        "recipe": INT6.recipe,
        "modelopt": INT6.modelopt,
    }
    fields.update(changes)
    return FormatSpec(**fields)  # type: ignore[arg-type]


def test_registering_the_same_spec_twice_is_a_no_op(int6: FormatSpec) -> None:
    assert register_format(int6) is int6
    assert QUANT_FORMATS.names().count("int6") == 1


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"format": "fp8"}, r"quantization format name 'fp8' is already registered"),
        ({"maxbound": 15.0}, r"quantization format name 'int6' is already registered"),
        (
            {"format": "int6b", "recipe": WeightRecipe("fp8")},
            r"recipe name 'fp8'.*recipe 'fp8' \(exportlm \(built in\)\); format 'int6b'",
        ),
        (
            {
                "format": "int6b",
                "recipe": WeightRecipe("int6b"),
                "modelopt": ModelOptScheme("W8A16", {}),
            },
            r"quant_algo name 'W8A16'.*format 'int8'",
        ),
    ],
)
def test_register_format_refuses_a_taken_name(
    int6: FormatSpec, changes: dict[str, object], match: str
) -> None:
    before = QUANT_FORMATS.names()
    with pytest.raises(RegistryConflictError, match=match):
        register_format(_variant(**changes))
    assert QUANT_FORMATS.names() == before
    assert get_format("fp8").format is QuantFormat.FP8


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"granularity": "block"}, "block_size is required by block formats"),
        ({"leaves": INT6.leaves[:1]}, "exactly one weight leaf has source 'data'"),
        ({"recipe": WeightRecipe("int6", quantize_inputs=True)}, "only a calibrated format"),
        ({"recipe": WeightRecipe("int6+kv")}, "no '\\+'"),
        ({"modelopt": None}, "declares a checkpoint scheme"),
    ],
)
def test_an_inconsistent_spec_is_refused_when_built(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _variant(**changes)


# -- the built-in specs describe what the exporters write -------------------------------------
@pytest.mark.parametrize("recipe", ["fp8+fp8_kv", "nvfp4", "int4_awq", "int8_wo"])
def test_built_in_specs_declare_exactly_the_leaves_written(recipe: str) -> None:
    model = quantize(DecoderModel(num_layers=1, hidden_size=128, intermediate_size=256), recipe)
    sink = DictSink()
    export_quantized_state(model, sink)
    checked = 0
    for name, module in model.named_modules():
        if not (isinstance(module, QuantLinear) and module.quant_algo):
            continue
        spec = module.weight_quantizer.spec
        leaves = _leaves(sink.tensors, name)
        declared = {leaf.name: leaf for leaf in spec.leaves}
        kv_role = module.output_quantizer.kv_role
        expected = {leaf.name for leaf in spec.leaves if leaf.role != "kv_cache"}
        expected |= {f"{kv_role}_scale"} if kv_role else set()
        if module.input_quantizer.folded_pre_quant_scale is not None:
            expected.discard("pre_quant_scale")  # AWQ scale folded into the preceding norm
        assert set(leaves) == expected, name
        for leaf_name, tensor in leaves.items():
            assert tensor.dtype == declared[leaf_name].dtype, f"{name}.{leaf_name}"
        assert leaves["weight"].shape == spec.packed_shape(tuple(module.weight.shape))
        with torch.no_grad():
            fake = module.weight_quantizer(module.effective_weight())
        # Exact on purpose: elementwise fake-quant vs the dequantized codes of the same tensor.
        assert torch.equal(dequantize(spec.from_leaves(leaves)), fake), name
        checked += 1
    assert checked == 7


def test_scale_leaves_come_from_the_specs() -> None:
    assert scale_leaf_names() == (
        "weight_scale",
        "weight_scale_2",
        "input_scale",
        "pre_quant_scale",
        "k_scale",
        "v_scale",
    )
    assert activation_leaf_names() == ("input_scale", "pre_quant_scale", "k_scale", "v_scale")


@pytest.mark.parametrize(
    ("fmt", "rows", "cols", "block", "problem"),
    [
        (QuantFormat.NVFP4, 8, 40, 16, "input features divisible by 16"),
        (QuantFormat.NVFP4, 7, 32, 16, None),
        (
            QuantFormat.INT4,
            7,
            128,
            128,
            "input features divisible by 128 and an even number of output features",
        ),
        (QuantFormat.INT4, 8, 256, 128, None),
        (QuantFormat.FP8, 7, 3, None, None),
    ],
)
def test_shape_rules_of_the_built_in_formats(
    fmt: QuantFormat, rows: int, cols: int, block: int | None, problem: str | None
) -> None:
    assert get_format(fmt).shape_problem(rows, cols, block) == problem


def test_modelopt_groups_of_the_built_in_formats() -> None:
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    assert get_format("fp8").modelopt_group(None) == {"input_activations": fp8, "weights": fp8}
    nvfp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert get_format("nvfp4").modelopt_group(None) == {
        "input_activations": nvfp4,
        "weights": nvfp4,
    }
    assert get_format("int4").modelopt_layer_config(128) == {
        "quant_algo": "W4A16_AWQ",
        "group_size": 128,
        "has_zero_point": False,
        "pre_quant_scale": True,
    }
    compressed = get_format("fp8").compressed_tensors
    assert compressed is not None
    assert list(compressed.group(["Linear"])) == [
        "targets",
        "weights",
        "input_activations",
        "format",
    ]
