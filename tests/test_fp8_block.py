"""``fp8_block``: FP8 weights per 128x128 tile, FP8 inputs per group of 128 at run time.

compressed-tensors' ``FP8_BLOCK`` (DeepSeek-V3 / Qwen3-FP8 checkpoints) on the seeded toy
Llama (float32; its ``k_proj`` / ``v_proj`` have 64 output rows: one partial row tile):
the kernels, the recipe (no calibration), the compressed-tensors layout, our loader
reading it back with the fake-quant logits, compressed-tensors' own preset, classes and
compressor on our config and codes, ``exportlm inspect``, the CLI, the refusals
(ModelOpt layout for blocks other than 128, input features not a multiple of the block, interleaved gate/up
experts), and a real-model export.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import exportlm
from exportlm.errors import UnsupportedFormatError
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import QuantLinear, check_recipe, dequantize, quantize, quantize_tensor
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, get_format
from tests._fake_quant import IDS
from tests._fake_quant import ct_group as _group
from tests._fake_quant import logits as _logits
from tests._fake_quant import quant_linears as _linears
from tests.test_interop import _tensors

LOGITS_ATOL = 1e-4
CT = "compressed-tensors"
ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _quantized(recipe: str = "fp8_block") -> nn.Module:
    return quantize(tiny_hf_model("llama", seed=0).eval(), recipe)


def _export(tmp_path: Path, recipe: str = "fp8_block") -> Path:
    out: Path = exportlm.export_model(
        "hf_checkpoint", _quantized(recipe), tmp_path / "ct", format=CT
    )
    return out


def test_weight_codes_have_one_scale_per_tile_the_last_row_tile_partial() -> None:
    w = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    w[4, :4] = 0.0  # a zero tile (the partial row tile's first) must not divide by zero
    q = quantize_tensor(w, "fp8_block", block_size=4)
    assert (q.data.dtype, q.data.shape, q.scale.shape) == (torch.float8_e4m3fn, (5, 8), (2, 2))
    want = torch.tensor(
        [
            [w[:4, :4].abs().max(), w[:4, 4:].abs().max()],
            [1.0 * 448, w[4:, 4:].abs().max()],  # the zero tile's scale is 1.0
        ]
    ) / torch.tensor(448.0)
    assert torch.equal(q.scale, want)
    per_element = want.repeat_interleave(4, 0)[:5].repeat_interleave(4, 1)
    assert torch.equal(q.data.float(), (w / per_element).to(torch.float8_e4m3fn).float())
    torch.testing.assert_close(dequantize(q, torch.float32), w, rtol=0.07, atol=0)


def test_the_recipe_calibrates_nothing_and_quantizes_inputs_per_group() -> None:
    assert check_recipe(tiny_hf_model("llama", seed=0), "fp8_block") is False
    q_proj = _linears(_quantized())["model.layers.0.self_attn.q_proj"]
    quantizer = q_proj.input_quantizer
    assert (quantizer.enabled, quantizer.spec.name, quantizer.amax) == (True, "fp8_group", None)
    x = torch.randn(2, 3, 2 * 64, generator=torch.Generator().manual_seed(2))
    q = _linears(_quantized("fp8_block:group_size=64"))["model.layers.0.self_attn.q_proj"]
    x[0, 1, :64] *= 100.0  # one loud group must not coarsen the token's other group
    groups = x.reshape(2, 3, 2, 64)
    scale = groups.abs().amax(dim=-1, keepdim=True) / torch.tensor(448.0)
    want = ((groups / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)
    assert torch.equal(q.input_quantizer(x), want)


def test_fake_quant_weights_equal_the_exported_codes_bit_for_bit(tmp_path: Path) -> None:
    tensors = _tensors(_export(tmp_path))
    spec, layout = get_format("fp8_block"), CHECKPOINT_LAYOUTS[CT]
    linears = _linears(_quantized())
    assert len(linears) == 7 * 2
    for name, module in linears.items():
        leaves = {leaf: tensors[f"{name}.{leaf}"] for leaf in ("weight", "weight_scale")}
        rows, cols = module.weight.shape
        assert leaves["weight_scale"].shape == (-(-rows // 128), cols // 128), name
        assert f"{name}.input_scale" not in tensors
        exported = dequantize(layout.from_leaves(spec, leaves), torch.float32)
        with torch.no_grad():
            assert torch.equal(module.weight_quantizer(module.weight), exported), name


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_block:group_size=32"])
def test_our_loader_reads_it_back_with_the_fake_quant_logits(recipe: str, tmp_path: Path) -> None:
    model = _quantized(recipe)
    loaded = exportlm.load_exported("hf_checkpoint", _export(tmp_path, recipe))
    got = _logits(loaded)
    torch.testing.assert_close(got, _logits(model), rtol=0, atol=LOGITS_ATOL)
    linears = _linears(model)  # ...and the inputs were quantized per group there
    for module in linears.values():
        module.input_quantizer.enabled = False
    try:
        weight_only = _logits(model)
    finally:
        for module in linears.values():
            module.input_quantizer.enabled = True
    assert (got - weight_only).abs().max() > 10 * LOGITS_ATOL


def test_the_group_option_sets_tiles_and_input_groups(tmp_path: Path) -> None:
    group = _group(_export(tmp_path, "fp8_block:group_size=32"))
    assert group["weights"]["block_structure"] == [32, 32]
    assert group["input_activations"]["group_size"] == 32
    tensors = _tensors(tmp_path / "ct")
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (128 // 32, 256 // 32)


def _no_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _no_nones(v) for k, v in value.items() if v is not None}
    return value


def test_the_group_is_compressed_tensors_fp8_block_preset(tmp_path: Path) -> None:
    qs = pytest.importorskip("compressed_tensors.quantization")
    out = _export(tmp_path)
    group = {k: v for k, v in _group(out).items() if k != "format"}
    assert _group(out)["format"] == "float-quantized"
    preset = qs.preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    assert qs.QuantizationScheme.model_validate(group) == preset
    assert _no_nones(preset.model_dump(mode="json")) == group
    assert inspect_checkpoint(out).summary["quantized_layers"] == {"fp8_block": 14}


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_block:group_size=32"])
def test_tensors_equal_compressed_tensors_compressor_bytes(recipe: str, tmp_path: Path) -> None:
    qs = pytest.importorskip("compressed_tensors.quantization")
    compressors = pytest.importorskip("compressed_tensors.compressors")
    out = _export(tmp_path, recipe)
    group = {k: v for k, v in _group(out).items() if k != "format"}
    scheme = qs.QuantizationScheme.model_validate(group)
    compressor = compressors.BaseCompressor.get_value_from_registry("float-quantized")
    spec, layout = get_format("fp8_block"), CHECKPOINT_LAYOUTS[CT]
    tensors = _tensors(out)
    for name in _linears(_quantized(recipe)):
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


def test_inspect_finds_no_error_and_a_wrong_tile_scale(tmp_path: Path) -> None:
    out = _export(tmp_path)
    report = inspect_checkpoint(out)
    assert report.errors == []
    # a scale laid out per 64 rows ([2, 1] for q_proj's [128, 128]) is a finding
    from safetensors.torch import load_file, save_file

    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    tensors[name] = torch.cat([tensors[name], tensors[name]])
    save_file(tensors, shard, metadata={"format": "pt"})
    found = [f for f in inspect_checkpoint(out).errors if f.subject == name]
    assert [f.rule for f in found] == ["block-scale-shape"]
    assert found[0].details["expected"] == [1, 1]


def test_the_modelopt_layout_refuses_other_blocks_naming_compressed_tensors(tmp_path: Path) -> None:
    """ModelOpt's FP8_PB_WO records no block size (vLLM reads 128): tests/test_fp8_pb_wo.py."""
    model = _quantized("fp8_block:group_size=32")
    with pytest.raises(UnsupportedFormatError, match="compressed-tensors"):
        exportlm.export_model("hf_checkpoint", model, tmp_path / "mo", format="modelopt")
    assert not (tmp_path / "mo").exists()


def test_input_features_not_a_multiple_of_the_block_are_refused_with_the_sizes_that_fit() -> None:
    model = nn.Sequential(nn.Linear(576, 200))
    with pytest.raises(UnsupportedFormatError, match=r"group_size=64 or group_size=32 divides 576"):
        quantize(model, "fp8_block")
    q = quantize(nn.Sequential(nn.Linear(576, 200)), "fp8_block:group_size=64")
    assert isinstance(q[0], QuantLinear)


@pytest.mark.parametrize("family", ["qwen3_moe", "llama4"])
def test_fused_moe_experts_load_back_with_the_fake_quant_logits(
    family: str, tmp_path: Path
) -> None:
    model = quantize(tiny_hf_model(family, seed=0).eval(), "fp8_block:group_size=32")
    ids = IDS.remainder(int(model.config.vocab_size))
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / family, format=CT)
    assert inspect_checkpoint(out).errors == []
    loaded = exportlm.load_exported("hf_checkpoint", out)
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids)
    torch.testing.assert_close(getattr(got, "logits", got), want, rtol=0, atol=LOGITS_ATOL)


def test_interleaved_gate_up_experts_are_refused() -> None:
    """GptOss interleaves gate and up rows: a tile would span both, and the checkpoint
    stores them apart, so the fake quantization could not match what is written."""
    with pytest.raises(UnsupportedFormatError, match="interleaves gate and up rows"):
        quantize(tiny_hf_model("gpt_oss", seed=0).eval(), "fp8_block:group_size=32")


def test_cli_exports_fp8_block(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "exportlm", "export", "--target", "hf_checkpoint"]
    cmd += ["--model", "llama", "--out", str(out), "--quantize", "fp8_block:group_size=64"]
    cmd += ["-o", "format=compressed-tensors"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert _group(out)["weights"]["block_structure"] == [64, 64]
    assert inspect_checkpoint(out).errors == []


@pytest.mark.real_model
def test_the_real_model_exports_from_its_directory(real_model_dir: Path, tmp_path: Path) -> None:
    """SmolLM2-135M: hidden size 576 is no multiple of 128, so tiles of 64 (9 x 64)."""
    from exportlm.cli import main

    out = tmp_path / "real"
    argv = ["export", "--target", "hf_checkpoint", "--model", str(real_model_dir)]
    argv += ["--out", str(out), "--quantize", "fp8_block:group_size=64", "-o", f"format={CT}"]
    assert main(argv) == 0
    assert _group(out)["weights"]["block_structure"] == [64, 64]
    report = inspect_checkpoint(out)
    assert report.errors == [], [f.message for f in report.errors]
    assert report.summary["quantized_layers"] == {"fp8_block": 30 * 7}


def test_the_engine_tables_name_it_fp8_block(tmp_path: Path) -> None:
    """vLLM's CPU build has no FP8 block GEMM without AMX (a GPU row); transformers runs it."""
    from exportlm.engines import Verdict, artifact_kind, get_engine

    kind = artifact_kind(_export(tmp_path, "fp8_block:group_size=32"))
    assert (kind.layout, kind.scheme) == (CT, "FP8_BLOCK")
    vllm = get_engine("vllm").support(kind.target, kind.layout, kind.scheme, dtype="bfloat16")
    assert vllm.verdict is Verdict.ENGINE_LIMIT
    assert "AMX" in vllm.reason
    assert (
        get_engine("vllm").support(kind.target, kind.layout, kind.scheme, device="cuda").verdict
        is Verdict.RUNS
    )
    transformers = get_engine("transformers").support(kind.target, kind.layout, kind.scheme)
    assert transformers.verdict is Verdict.RUNS


def test_onnx_refuses_it_naming_the_recipe(tmp_path: Path) -> None:
    from exportlm.errors import InvalidModelError

    with pytest.raises(InvalidModelError, match=r"'fp8_block'.*cannot express"):
        exportlm.export_model("onnx", _quantized(), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def _rewrite_group(out: Path, weights: dict[str, Any], inputs: dict[str, Any]) -> None:
    config = json.loads((out / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["weights"].update(weights)
    group["input_activations"].update(inputs)
    (out / "config.json").write_text(json.dumps(config))
    (out / "exportlm-manifest.json").unlink()  # a foreign checkpoint has none


def test_a_group_as_llm_compressor_writes_it_reads_as_fp8_block(tmp_path: Path) -> None:
    """llm-compressor serializes every args key (``observer``, ``actorder: null``...)."""
    out = _export(tmp_path, "fp8_block:group_size=32")
    extra = {"observer": "static_minmax", "actorder": None, "scale_dtype": None}
    _rewrite_group(out, extra, {**extra, "observer": None, "block_structure": None})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no manifest: unverified
        loaded = exportlm.load_exported("hf_checkpoint", out)
    want = _logits(_quantized("fp8_block:group_size=32"))
    torch.testing.assert_close(_logits(loaded), want, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.filterwarnings("ignore")  # no manifest: unverified
@pytest.mark.parametrize(
    ("weights", "inputs"),
    [
        ({"block_structure": [64, 32]}, {}),  # tiles of 64 rows: scales read per 32 would misalign
        ({}, {"group_size": 64}),  # input groups that are not the tiles' edge
    ],
)
def test_a_tile_shape_the_tensors_do_not_have_is_refused_not_misread(
    weights: dict[str, Any], inputs: dict[str, Any], tmp_path: Path
) -> None:
    out = _export(tmp_path, "fp8_block:group_size=32")
    _rewrite_group(out, weights, inputs)
    with pytest.raises(UnsupportedFormatError, match="config group"):
        exportlm.load_exported("hf_checkpoint", out)
