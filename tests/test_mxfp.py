"""``mxfp4`` / ``mxfp8``: OCP microscaling, one E8M0 scale per block of 32 input features.

The kernels against hand-computed E8M0 exponents, the recipes (no calibration; MXFP8's
inputs per block of 32 of each token at run time), both checkpoint layouts, our loader
reading both back with the fake-quant logits (dense and MoE), compressed-tensors' own
presets and compressors and ModelOpt's own kernels on our codes, ``exportlm inspect``,
the refusals and the CLI.
"""

from __future__ import annotations

import functools
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import exportlm
from exportlm.cli import main
from exportlm.engines import Verdict, artifact_kind, get_engine
from exportlm.errors import (
    InvalidModelError,
    MalformedCheckpointError,
    UnknownOptionError,
    UnsupportedFormatError,
)
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import check_recipe, dequantize, quantize, quantize_tensor
from exportlm.quant.formats import CHECKPOINT_LAYOUTS, get_format
from tests._fake_quant import IDS
from tests._fake_quant import logits as _logits
from tests._fake_quant import quant_linears as _linears
from tests.test_interop import _tensors

LAYOUTS = ("modelopt", "compressed-tensors")
RECIPES = ("mxfp4", "mxfp8")
#: Stated tolerance of the loaded checkpoint's logits against the fake-quant model's: the
#: weights dequantize bit for bit, only the forward's summation order may differ.
LOGITS_ATOL = 1e-4
#: compressed-tensors' preset of each recipe (``quant_scheme.py``).
CT_PRESETS = {"mxfp4": "MXFP4A16", "mxfp8": "MXFP8"}


@functools.cache
def _quantized(recipe: str) -> nn.Module:
    return quantize(tiny_hf_model("llama", seed=0).eval(), recipe)


@functools.cache
def _exported(recipe: str, layout: str, root: Path) -> Path:
    out: Path = exportlm.export_model(
        "hf_checkpoint", _quantized(recipe), root / f"{recipe}-{layout}", format=layout
    )
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mxfp")


def _config(out: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((out / "config.json").read_text())["quantization_config"]
    return config


# -- numerics ---------------------------------------------------------------------------


def _one_block(*values: float) -> torch.Tensor:
    x = torch.zeros(1, 32)
    x[0, : len(values)] = torch.tensor(values)
    return x


@pytest.mark.parametrize(
    ("recipe", "amax", "code"),
    [
        # scale = 2 ** (e - emax), emax 2 (E2M1) / 8 (E4M3), bias 127, amax = m * 2**e with
        # m in [1, 2), e one higher where m >= 1.75
        ("mxfp4", 1.0, 127 + 0 - 2),
        ("mxfp4", 6.5, 127 + 2 - 2),  # m 1.625: kept
        ("mxfp4", 7.0, 127 + 3 - 2),  # m 1.75: rounded up
        ("mxfp8", 448.0, 127 + 9 - 8),  # m 1.75: rounded up (ModelOpt's ceil keeps 2**0 here)
        ("mxfp4", 1.75 - 2.0**-22, 127 + 0 - 2),  # the boundary, exactly: just below 1.75
        ("mxfp4", 1.75, 127 + 1 - 2),
        ("mxfp4", 1.0 - 2.0**-24, 127 + 0 - 2),  # m just below 2: rounded up to 2**0
        ("mxfp4", 0.0, 0),  # a zero block: the smallest exponent, -127
        ("mxfp8", 1.0, 127 + 0 - 8),
        ("mxfp8", 896.0, 127 + 10 - 8),
        ("mxfp8", 800.0, 127 + 9 - 8),
        ("mxfp8", 2.0**-110, 127 - 110 - 8),
        ("mxfp8", 2.0**-120, 0),  # -128 clamped at -127
    ],
)
def test_shared_scale_is_the_e8m0_exponent_of_the_rounded_amax(
    recipe: str, amax: float, code: int
) -> None:
    q = quantize_tensor(_one_block(amax, -amax / 3), recipe, block_size=32)
    assert (q.scale.dtype, q.scale.shape) == (torch.uint8, (1, 1))
    assert int(q.scale) == code


def test_mxfp4_elements_round_to_e2m1_and_saturate() -> None:
    # amax 6.5 -> scale 1: 6.5 saturates to 6 (code 7), 2.5 ties to even 2 (code 4), -0.25
    # ties to -0 (code 8), -1.5 is code 8 | 3; two codes per byte, the even column low
    x = _one_block(6.5, 2.5, -0.25, -1.5, 0.0, 5.5)
    q = quantize_tensor(x, "mxfp4", block_size=32)
    assert (q.data.dtype, q.data.shape) == (torch.uint8, (1, 16))
    assert q.data[0, :3].tolist() == [4 << 4 | 7, 11 << 4 | 8, 7 << 4 | 0]
    values = dequantize(q, torch.float32)[0, :6].tolist()
    assert values == [6.0, 2.0, -0.0, -1.5, 0.0, 6.0]


def test_mxfp8_elements_are_e4m3_of_the_block_scaled_values() -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    q = quantize_tensor(x, "mxfp8", block_size=32)
    amax = x.reshape(4, 2, 32).abs().amax(-1)
    floor = torch.floor(torch.log2(amax))
    exponent = floor + (amax / 2.0**floor >= 1.75).float() - 8
    assert torch.equal(q.scale.to(torch.int32) - 127, exponent.to(torch.int32))
    scale = (2.0**exponent).repeat_interleave(32, dim=-1)
    want = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.data.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(dequantize(q, torch.float32), want.float() * scale)


def test_a_block_of_another_size_is_refused() -> None:
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_tensor(torch.ones(2, 64), "mxfp4", block_size=64)


# -- recipes and fake quantization ------------------------------------------------------


def test_the_recipes_calibrate_nothing_and_only_mxfp8_quantizes_inputs() -> None:
    for recipe in RECIPES:
        assert check_recipe(tiny_hf_model("llama", seed=0), recipe) is False
    mx4 = _linears(_quantized("mxfp4"))["model.layers.0.self_attn.q_proj"]
    assert not mx4.input_quantizer.enabled  # weight-only, as gpt-oss ships it
    mx8 = _linears(_quantized("mxfp8"))["model.layers.0.self_attn.q_proj"]
    assert mx8.input_quantizer.enabled
    assert (mx8.input_quantizer.spec.name, mx8.input_quantizer.block_size) == ("mxfp8", 32)
    x = torch.randn(2, 5, mx8.in_features, generator=torch.Generator().manual_seed(2))
    x[0, 1, :32] *= 1000.0  # one loud block must not coarsen the token's other blocks
    want = dequantize(quantize_tensor(x, "mxfp8", block_size=32), torch.float32)
    assert torch.equal(mx8.input_quantizer(x), want)


def test_input_features_not_divisible_by_32_are_refused_naming_the_shape() -> None:
    model = nn.Sequential(nn.Linear(48, 64), nn.Linear(64, 8))
    for recipe in RECIPES:
        with pytest.raises(UnsupportedFormatError, match=r"divisible by 32.*\(64, 48\)"):
            quantize(model, recipe)


def test_the_block_size_is_not_an_option() -> None:
    with pytest.raises(UnknownOptionError, match="'group_size'; accepted: \\(none\\)"):
        quantize(tiny_hf_model("llama", seed=0), "mxfp4", group_size=64)


def test_onnx_refuses_mx_weights() -> None:
    with pytest.raises(InvalidModelError, match=r"'mxfp4'.*cannot express"):
        exportlm.export_model("onnx", _quantized("mxfp4"), Path("unused.onnx"))


# -- checkpoint layouts -----------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fake_quant_weights_equal_the_exported_codes_bit_for_bit(
    recipe: str, layout: str, root: Path
) -> None:
    tensors = _tensors(_exported(recipe, layout, root))
    spec, stored = get_format(recipe), CHECKPOINT_LAYOUTS[layout]
    linears = _linears(_quantized(recipe))
    assert len(linears) == 7 * 2
    names = [leaf.name for leaf in stored.weight_leaves(spec)]
    for name, module in linears.items():
        leaves = {leaf: tensors[f"{name}.{leaf}"] for leaf in names}
        assert f"{name}.input_scale" not in tensors
        exported = dequantize(stored.from_leaves(spec, leaves), torch.float32)
        with torch.no_grad():
            fake = module.weight_quantizer(module.weight)
        assert torch.equal(fake, exported), name


@pytest.mark.parametrize(
    ("recipe", "algo", "codes"),
    [("mxfp4", "mxfp4", (torch.uint8, 2)), ("mxfp8", "MXFP8", (torch.float8_e4m3fn, 1))],
)
def test_modelopt_layout_names_dtypes_and_shapes(
    recipe: str, algo: str, codes: tuple[torch.dtype, int], root: Path
) -> None:
    out = _exported(recipe, "modelopt", root)
    declared = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert declared["quant_algo"] == algo
    assert _config(out)["quant_algo"] == algo
    assert "config_groups" not in _config(out)  # ModelOpt writes none for either
    tensors = _tensors(out)
    weight = tensors["model.layers.0.mlp.down_proj.weight"]
    scale = tensors["model.layers.0.mlp.down_proj.weight_scale"]
    rows, cols = 128, 256  # the toy's down_proj
    assert (weight.dtype, weight.shape) == (codes[0], (rows, cols // codes[1]))
    assert (scale.dtype, scale.shape) == (torch.uint8, (rows, cols // 32))


@pytest.mark.parametrize("recipe", RECIPES)
def test_compressed_tensors_group_is_the_library_preset(recipe: str, root: Path) -> None:
    qs = pytest.importorskip("compressed_tensors.quantization")
    config = _config(_exported(recipe, "compressed-tensors", root))
    group = config["config_groups"]["group_0"]
    fmt = {"mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized"}[recipe]
    assert (group["format"], config["format"]) == (fmt, fmt)
    scheme = qs.QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    assert scheme == qs.preset_name_to_scheme(CT_PRESETS[recipe], ["Linear"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_tensors_equal_compressed_tensors_compressor_bytes(recipe: str, root: Path) -> None:
    qs = pytest.importorskip("compressed_tensors.quantization")
    compressors = pytest.importorskip("compressed_tensors.compressors")
    out = _exported(recipe, "compressed-tensors", root)
    group = _config(out)["config_groups"]["group_0"]
    scheme = qs.QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    compressor = compressors.BaseCompressor.get_value_from_registry(group["format"])
    spec, layout = get_format(recipe), CHECKPOINT_LAYOUTS["compressed-tensors"]
    names = [leaf.name for leaf in layout.weight_leaves(spec)]
    tensors = _tensors(out)
    for name in _linears(_quantized(recipe)):
        ours = {leaf: tensors[f"{name}.{leaf}"] for leaf in names}
        weight = dequantize(layout.from_leaves(spec, ours), torch.float32)
        scale = 2.0 ** (ours["weight_scale"].to(torch.int32) - 127).float()
        theirs = compressor.compress({"weight": weight, "weight_scale": scale}, scheme)
        assert set(theirs) == set(ours), name
        for leaf, mine in ours.items():
            ref = theirs[leaf].contiguous()
            assert (mine.dtype, mine.shape) == (ref.dtype, ref.shape), f"{name}.{leaf}"
            assert torch.equal(
                mine.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)
            )


def test_mxfp8_codes_equal_modelopt_s_kernel_with_our_scales() -> None:
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    ours = quantize_tensor(w, "mxfp8", block_size=32)
    theirs = qtensor.MXFP8QTensor.quantize_with_scale(w, ours.scale)
    assert torch.equal(theirs.view(torch.uint8), ours.data.view(torch.uint8))


@pytest.mark.parametrize(("recipe", "bits"), [("mxfp4", 4), ("mxfp8", 8)])
def test_shared_scales_equal_compressed_tensors_own_on_a_real_range_of_weights(
    recipe: str, bits: int
) -> None:
    """The E8M0 codes of a weight are compressed-tensors' ``generate_mx_scales`` of its block
    maxima (what llm-compressor writes), in float32 and bfloat16, over 2**-20 to 2**20."""
    mx_utils = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    gen = torch.Generator().manual_seed(0)
    magnitude = 2.0 ** torch.randint(-20, 20, (256, 8, 1), generator=gen).float()
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(256, 8, 32, generator=gen) * magnitude).reshape(256, 256).to(dtype)
        ours = quantize_tensor(w, recipe, block_size=32)
        amax = w.reshape(256, 8, 32).abs().amax(-1)
        theirs = mx_utils.generate_mx_scales(amax, bits)
        assert torch.equal(ours.scale, theirs.to(torch.uint8)), dtype


def test_mxfp8_scales_equal_modelopt_s_own() -> None:
    """ModelOpt's ``ceil(log2(amax / 448))``: the same exponent but at a mantissa of exactly
    1.75, which a random weight's block maxima never have."""
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    ours = quantize_tensor(w, "mxfp8", block_size=32)
    theirs = qtensor.MXFP8QTensor.get_weights_scaling_factor(w)
    assert torch.equal(theirs.reshape(ours.scale.shape).to(torch.uint8), ours.scale)


def test_mxfp4_bytes_equal_modelopt_s_where_the_exponent_rules_agree() -> None:
    """ModelOpt picks ``ceil(log2(amax / 6))``, ours rounds the amax up from a mantissa of
    1.75: equal for a block amax in ``[4, 6] * 2**k``; there codes and scales are byte for
    byte ModelOpt's."""
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randn(64, 4, 32, generator=gen)
    k = torch.randint(-6, 4, (64, 4, 1), generator=gen).float()
    target = (4 + 2 * torch.rand(64, 4, 1, generator=gen)) * 2.0**k
    w = (blocks / blocks.abs().amax(-1, keepdim=True) * target).reshape(64, 128)
    ours = quantize_tensor(w, "mxfp4", block_size=32)
    packed, scales = qtensor.MXFP4QTensor.quantize(w, 32)
    assert torch.equal(scales.reshape(64, 4), ours.scale)
    assert torch.equal(packed._quantized_data, ours.data)


def test_the_mixed_precision_group_equals_modelopt_s_own() -> None:
    convert = pytest.importorskip("modelopt.torch.export.convert_hf_config")
    spec = get_format("mxfp8")
    assert spec.modelopt_group(None) == convert._quant_algo_to_group_config("MXFP8", 32)


# -- loading back, inspect ---------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_our_loader_reads_each_layout_with_the_fake_quant_logits(
    recipe: str, layout: str, root: Path
) -> None:
    out = _exported(recipe, layout, root)
    loaded = exportlm.load_exported("hf_checkpoint", out)
    torch.testing.assert_close(
        _logits(loaded), _logits(_quantized(recipe)), rtol=0, atol=LOGITS_ATOL
    )
    report = inspect_checkpoint(out)
    assert report.errors == []
    assert report.summary["quantized_layers"] == {recipe: 14}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_experts_load_back_with_the_fake_quant_logits(
    recipe: str, layout: str, family: str, tmp_path: Path
) -> None:
    model = quantize(tiny_hf_model(family, seed=0).eval(), recipe)
    ids = IDS.remainder(int(model.config.vocab_size))
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / family, format=layout)
    assert inspect_checkpoint(out).errors == []
    experts = {n: t for n, t in _tensors(out).items() if "experts" in n}
    assert any(n.endswith("weight_scale") and t.dtype == torch.uint8 for n, t in experts.items())
    loaded = exportlm.load_exported("hf_checkpoint", out)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_e8m0_nan_scale_is_an_inspect_error_and_the_loader_refuses_it(
    layout: str, root: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(_exported("mxfp4", layout, root), bad)
    (bad / "exportlm-manifest.json").unlink()  # a foreign checkpoint: no digests to stop it
    tensors = _tensors(bad)
    name = "model.layers.1.mlp.up_proj.weight_scale"
    tensors[name][3, 1] = 255  # E8M0's NaN
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    errors = inspect_checkpoint(bad).errors
    assert [(f.rule, f.subject) for f in errors] == [("scale-nonfinite", name)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no manifest: unverified
        with pytest.raises(MalformedCheckpointError, match=r"up_proj\.weight_scale.*NaN code"):
            exportlm.load_exported("hf_checkpoint", bad)


def test_cli_exports_mxfp4_and_verifies_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    argv = ["export", "--target", "hf_checkpoint", "--model", "llama", "--out", str(out)]
    assert (
        main(
            [*argv, "--quantize", "mxfp4", "-o", "format=compressed-tensors", "--json", "--verify"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["verify"]["passed"]
    assert _config(out)["format"] == "mxfp4-pack-quantized"
    assert inspect_checkpoint(out).errors == []


@pytest.mark.parametrize(
    ("recipe", "layout", "scheme", "verdict"),
    [
        ("mxfp8", "modelopt", "MXFP8", Verdict.ENGINE_LIMIT),  # vLLM's modelopt_mxfp8: CUDA
        ("mxfp4", "modelopt", "mxfp4", Verdict.REFUSED),  # not in vLLM's ModelOpt QUANT_ALGOS
        ("mxfp4", "compressed-tensors", "MXFP4A16", Verdict.ENGINE_LIMIT),
        ("mxfp8", "compressed-tensors", "MXFP8", Verdict.ENGINE_LIMIT),
    ],
)
def test_the_checkpoint_room_names_the_scheme_and_vllm_s_row_holds_it(
    recipe: str, layout: str, scheme: str, verdict: Verdict, root: Path
) -> None:
    kind = artifact_kind(_exported(recipe, layout, root))
    assert (kind.layout, kind.scheme) == (layout, scheme)
    match = get_engine("vllm").support(
        "hf_checkpoint", layout, scheme, dtype="bfloat16", device="cpu"
    )
    assert match.verdict is verdict
    assert (
        ("CUDA" in match.reason) if verdict is Verdict.ENGINE_LIMIT else "MXFP4A16" in match.reason
    )
