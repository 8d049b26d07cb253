"""``fp8_dynamic``: FP8 per-channel weights, FP8 inputs quantized per token at run time.

ModelOpt's ``FP8_PER_CHANNEL_PER_TOKEN`` and compressed-tensors' ``FP8_DYNAMIC`` on the
seeded toy Llama (float32): the kernel, the recipe (no calibration), both checkpoint
layouts, our loader reading both back with the fake-quant logits, compressed-tensors'
own classes and compressor on our config and codes, and ``exportlm inspect``.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import exportlm
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import check_recipe, dequantize, quantize, quantize_tensor
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, get_format
from tests._fake_quant import IDS
from tests._fake_quant import logits as _logits
from tests._fake_quant import quant_linears as _linears
from tests.test_interop import _tensors

LAYOUTS = ("modelopt", "compressed-tensors")
LOGITS_ATOL = 1e-4
#: The tokens every forward of this file runs.


def _model() -> nn.Module:
    return quantize(tiny_hf_model("llama", seed=0).eval(), "fp8_dynamic")


@functools.cache
def _quantized() -> nn.Module:
    return _model()


def _export(tmp_path: Path, layout: str) -> Path:
    out: Path = exportlm.export_model(
        "hf_checkpoint", _quantized(), tmp_path / layout, format=layout
    )
    return out


def test_weight_codes_are_fp8_with_one_scale_per_output_row() -> None:
    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    w[2] = 0.0  # a zero row must not divide by zero
    q = quantize_tensor(w, "fp8_dynamic")
    assert (q.data.dtype, q.data.shape) == (torch.float8_e4m3fn, (6, 32))
    assert (q.scale.dtype, q.scale.shape) == (torch.float32, (6,))
    want = w.abs().amax(dim=-1) / torch.tensor(448.0)
    want[2] = 1.0
    assert torch.equal(q.scale, want)
    assert torch.equal(q.data.float(), (w / want.unsqueeze(-1)).to(torch.float8_e4m3fn).float())
    assert q.data.float().abs().amax(dim=-1)[[0, 1, 3]].eq(448.0).all()  # each row's max
    assert not q.data[2].float().any()
    torch.testing.assert_close(dequantize(q, torch.float32), w, rtol=0.07, atol=0)


def test_the_recipe_calibrates_nothing() -> None:
    assert check_recipe(tiny_hf_model("llama", seed=0), "fp8_dynamic") is False
    model = _quantized()  # quantize() ran with no calibrate callback
    q_proj = _linears(model)["model.layers.0.self_attn.q_proj"]
    assert q_proj.input_quantizer.enabled
    assert q_proj.input_quantizer.spec.name == "fp8_dynamic"
    assert q_proj.input_quantizer.amax is None  # nothing static: scales per token


def test_inputs_are_quantized_per_token_in_the_fake_quant_forward() -> None:
    q_proj = _linears(_quantized())["model.layers.0.self_attn.q_proj"]
    x = torch.randn(2, 5, q_proj.in_features, generator=torch.Generator().manual_seed(2))
    x[0, 1] *= 100.0  # one loud token must not coarsen the others
    scale = (x.abs().amax(dim=-1, keepdim=True) / torch.tensor(448.0)).float()
    want = (x / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(q_proj.input_quantizer(x), want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_quant_weights_equal_the_exported_codes_bit_for_bit(
    layout: str, tmp_path: Path
) -> None:
    tensors = _tensors(_export(tmp_path, layout))
    spec, stored = get_format("fp8_dynamic"), CHECKPOINT_LAYOUTS[layout]
    linears = _linears(_quantized())
    assert len(linears) == 7 * 2  # every linear of both layers; lm_head is excluded
    for name, module in linears.items():
        leaves = {leaf: tensors[f"{name}.{leaf}"] for leaf in ("weight", "weight_scale")}
        assert f"{name}.input_scale" not in tensors
        exported = dequantize(stored.from_leaves(spec, leaves), torch.float32)
        with torch.no_grad():
            fake = module.weight_quantizer(module.weight)
        assert torch.equal(fake, exported), name


def test_modelopt_layout_declares_fp8_per_channel_per_token(tmp_path: Path) -> None:
    out = _export(tmp_path, "modelopt")
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["quant_algo"]) == (
        "modelopt",
        "FP8_PER_CHANNEL_PER_TOKEN",
    )
    tensors = _tensors(out)
    weight = tensors["model.layers.0.mlp.down_proj.weight"]
    scale = tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert (weight.dtype, scale.dtype, scale.shape) == (
        torch.float8_e4m3fn,
        torch.float32,
        (weight.shape[0],),
    )
    assert not [n for n in tensors if n.endswith("input_scale")]


def test_compressed_tensors_layout_is_the_fp8_dynamic_group(tmp_path: Path) -> None:
    out = _export(tmp_path, "compressed-tensors")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    args = {"num_bits": 8, "type": "float", "symmetric": True}
    assert config["config_groups"] == {
        "group_0": {
            "targets": ["Linear"],
            "weights": {**args, "strategy": "channel", "dynamic": False},
            "input_activations": {**args, "strategy": "token", "dynamic": True},
            "format": "float-quantized",
        }
    }
    tensors = _tensors(out)
    weight = tensors["model.layers.1.self_attn.o_proj.weight"]
    scale = tensors["model.layers.1.self_attn.o_proj.weight_scale"]
    assert (weight.dtype, scale.shape) == (torch.float8_e4m3fn, (weight.shape[0], 1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_our_loader_reads_each_layout_with_the_fake_quant_logits(
    layout: str, tmp_path: Path
) -> None:
    model = _quantized()
    want = _logits(model)
    loaded = exportlm.load_exported("hf_checkpoint", _export(tmp_path, layout))
    got = _logits(loaded)
    torch.testing.assert_close(got, want, rtol=0, atol=LOGITS_ATOL)
    # ...and the inputs were quantized per token there: without it the logits move
    linears = _linears(model)
    for module in linears.values():
        module.input_quantizer.enabled = False
    try:
        weight_only = _logits(model)
    finally:
        for module in linears.values():
            module.input_quantizer.enabled = True
    assert (got - weight_only).abs().max() > 10 * LOGITS_ATOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_finds_no_error_in_either_layout(layout: str, tmp_path: Path) -> None:
    report = inspect_checkpoint(_export(tmp_path, layout))
    assert report.errors == []
    assert {f.rule for f in report.findings} >= {"quant-method-loaders"}


def _no_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _no_nones(v) for k, v in value.items() if v is not None}
    return value


def test_the_group_is_compressed_tensors_fp8_dynamic_preset(tmp_path: Path) -> None:
    qs = pytest.importorskip("compressed_tensors.quantization")
    out = _export(tmp_path, "compressed-tensors")
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"][
        "group_0"
    ]
    scheme = qs.QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    preset = qs.preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    assert scheme == preset
    assert _no_nones(preset.model_dump(mode="json")) == {
        k: v for k, v in group.items() if k != "format"
    }


def test_tensors_equal_compressed_tensors_compressor_bytes(tmp_path: Path) -> None:
    qs = pytest.importorskip("compressed_tensors.quantization")
    compressors = pytest.importorskip("compressed_tensors.compressors")
    out = _export(tmp_path, "compressed-tensors")
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"][
        "group_0"
    ]
    scheme = qs.QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    compressor = compressors.BaseCompressor.get_value_from_registry("float-quantized")
    spec, layout = get_format("fp8_dynamic"), CHECKPOINT_LAYOUTS["compressed-tensors"]
    tensors = _tensors(out)
    for name in _linears(_quantized()):
        ours = {leaf: tensors[f"{name}.{leaf}"] for leaf in ("weight", "weight_scale")}
        weight = dequantize(layout.from_leaves(spec, ours), torch.float32)
        theirs = compressor.compress(
            {"weight": weight, "weight_scale": ours["weight_scale"]}, scheme
        )
        assert set(theirs) == set(ours), name
        for leaf, mine in ours.items():
            ref = theirs[leaf].contiguous()
            assert (mine.dtype, mine.shape) == (ref.dtype, ref.shape), f"{name}.{leaf}"
            assert torch.equal(
                mine.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)
            )


def test_the_modelopt_group_equals_modelopt_s_own() -> None:
    """Mixed precision writes a group per layer config: ModelOpt 0.47's for this algorithm."""
    convert = pytest.importorskip("modelopt.torch.export.convert_hf_config")
    spec = get_format("fp8_dynamic")
    assert spec.modelopt_layer_config(None) == {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
    theirs = convert._quant_algo_to_group_config("FP8_PER_CHANNEL_PER_TOKEN")
    assert spec.modelopt_group(None) == theirs


def test_mixed_with_static_fp8_loads_back_in_the_modelopt_layout(tmp_path: Path) -> None:
    """Per-token inputs on attention, static FP8 inputs on the MLP: each layer as declared."""
    model = tiny_hf_model("llama", seed=0).eval()
    quantize(model, {"*": "fp8_dynamic", "*.mlp.*": "fp8"}, calibrate=lambda m: m(IDS))
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "mixed")
    layers = json.loads((out / "hf_quant_config.json").read_text())["quantization"][
        "quantized_layers"
    ]
    assert layers["model.layers.0.self_attn.q_proj"] == {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
    assert layers["model.layers.0.mlp.up_proj"] == {"quant_algo": "FP8"}
    assert inspect_checkpoint(out).errors == []
    loaded = exportlm.load_exported("hf_checkpoint", out)
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_experts_load_back_with_the_fake_quant_logits(
    family: str, layout: str, tmp_path: Path
) -> None:
    """Iterable (Mixtral), fused (Qwen3-MoE) and biased fused (GptOss) experts: row scales
    per expert, per-token inputs in the runtime too."""
    model = quantize(tiny_hf_model(family, seed=0).eval(), "fp8_dynamic")
    ids = IDS.remainder(int(model.config.vocab_size))
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / family, format=layout)
    assert inspect_checkpoint(out).errors == []
    experts = {n: t for n, t in _tensors(out).items() if "experts" in n}
    assert any(t.dtype == torch.float8_e4m3fn for t in experts.values()), sorted(experts)
    loaded = exportlm.load_exported("hf_checkpoint", out)
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids)
    torch.testing.assert_close(getattr(got, "logits", got), want, rtol=0, atol=LOGITS_ATOL)


def test_a_group_as_llm_compressor_writes_it_reads_as_fp8_dynamic(tmp_path: Path) -> None:
    """llm-compressor serializes every args key (``observer``, ``group_size: null``...) and
    ``output_activations: null``: the loader matches the group by what it means."""
    out = _export(tmp_path, "compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    extra = {"actorder": None, "block_structure": None, "observer_kwargs": {}}
    config["quantization_config"]["config_groups"]["group_0"] = {
        "targets": ["Linear"],
        "weights": {**args, **extra, "strategy": "channel", "dynamic": False, "observer": "minmax"},
        "input_activations": {**args, **extra, "strategy": "token", "dynamic": True},
        "output_activations": None,
        "format": None,  # the config's top-level format names it
    }
    (out / "config.json").write_text(json.dumps(config))
    (out / "exportlm-manifest.json").unlink()  # a foreign checkpoint has none
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no manifest: unverified
        loaded = exportlm.load_exported("hf_checkpoint", out)
    torch.testing.assert_close(_logits(loaded), _logits(_quantized()), rtol=0, atol=LOGITS_ATOL)
