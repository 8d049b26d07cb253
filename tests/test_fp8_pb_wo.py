"""``fp8_block`` in the ModelOpt layout: ModelOpt 0.47's ``FP8_PB_WO`` (``quant_algo: "fp8_pb_wo"``).

What ModelOpt writes for ``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG`` (``export_hf_checkpoint``, run
here on CPU): ``hf_quant_config.json`` ``{"quant_algo": "fp8_pb_wo", "kv_cache_quant_algo":
null, "exclude_modules": [...]}`` (no ``group_size``), ``config.json``'s ``quantization_config``
``{"ignore", "quant_algo", "producer", "quant_method": "modelopt"}`` (no ``config_groups``), per
quantized linear ``weight`` float8_e4m3fn and ``weight_scale`` float32
``[ceil(out / 128), 1, in / 128, 1]`` (0-d where a weight is one tile: ``reduce_amax`` squeezes a
one-element amax; we write ``[1, 1, 1, 1]``, which vLLM loads). Its config records no block size and vLLM reads 128 x 128 tiles, so the
layout holds blocks of 128 only. ModelOpt's model keeps its inputs in float (weight only), but
vLLM serves the checkpoint with inputs quantized per token and group of 128 at run time
(``resolve``: ``kFp8Dynamic128Sym``): what ``fp8_block`` computes, and what our loader runs.
"""

from __future__ import annotations

import copy
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
from exportlm.errors import MalformedCheckpointError, UnsupportedFormatError
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import QuantRecipe, check_layout, quantize
from tests._fake_quant import edit_checkpoint_tensors, load_unverified
from tests.test_fp8_block_native import _logits, _vllm_python, _weight_only_logits
from tests.test_interop import _assert_same_tensor, _tensors

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "exportlm-manifest.json"
IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
#: Our loader against the fake-quant model (measured 0.0 on the toy Llama; room for another BLAS).
LOGITS_ATOL = 1e-4
#: Llama with hidden 256: every q / k / v and gate / up weight spans whole 128 x 128 tiles;
#: k_proj / v_proj of 128 rows (2 KV heads of 64): with 64 (heads of 32) vLLM's fused
#: qkv_proj loader fails on the tile (``fp8-block-fused-rows``, tests/test_inspect_fused_rows.py).
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
#: (family, overrides): Llama, Qwen3-MoE's experts (written per expert, as ModelOpt unfuses them).
MODELS = [("llama", WIDE), ("qwen3_moe", {"hidden_size": 256, "moe_intermediate_size": 256})]


def _model(family: str = "llama", **overrides: Any) -> nn.Module:
    model = tiny_hf_model(family, seed=0, **overrides).eval()
    model.config.architectures = [type(model).__name__]  # ModelOpt reads it
    return model


@functools.cache
def _quantized(recipe: str = "fp8_block", family: str = "llama", wide: bool = False) -> nn.Module:
    return quantize(_model(family, **(WIDE if wide else {})), recipe)


def _modelopt_export(model: nn.Module, out: Path, block: int = 128) -> Path:
    """ModelOpt's own quantize (``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG``, blocks of ``block``) and
    ``export_hf_checkpoint`` of a copy of ``model``."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    modelopt_export = pytest.importorskip("modelopt.torch.export")
    config = copy.deepcopy(mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
    for entry in config["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer":
            entry["cfg"]["block_sizes"] = {-1: block, -2: block}
    theirs = copy.deepcopy(model)
    ids = IDS.remainder(int(model.config.vocab_size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(theirs, config, forward_loop=lambda m: m(ids))
        modelopt_export.export_hf_checkpoint(theirs, export_dir=out)
    return out


def _configs(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``hf_quant_config.json`` and ``config.json``'s ``quantization_config``, producer aside."""
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    hf_quant.pop("producer")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    config.pop("producer")
    return hf_quant, config


# ----------------------------------------------------------------------------- ModelOpt's export


@pytest.mark.interop
@pytest.mark.parametrize(("family", "overrides"), MODELS, ids=[m[0] for m in MODELS])
def test_checkpoint_equals_modelopts_export(
    family: str, overrides: dict[str, int], tmp_path: Path
) -> None:
    """Names, dtypes, shapes and bytes of every tensor, and both configs key for key."""
    model = _model(family, **overrides)
    ref = _modelopt_export(model, tmp_path / "modelopt")
    ours = exportlm.export_model(
        "hf_checkpoint", quantize(copy.deepcopy(model), "fp8_block"), tmp_path / "ours"
    )
    mine, theirs = _tensors(ours), _tensors(ref)
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():
        _assert_same_tensor(name, mine[name], tensor)
    assert _configs(ours) == _configs(ref)
    hf_quant, config = _configs(ours)
    assert hf_quant["quantization"]["quant_algo"] == "fp8_pb_wo"
    assert "group_size" not in hf_quant["quantization"]
    assert "config_groups" not in config
    scale = mine["model.layers.0.self_attn.k_proj.weight_scale"]  # [128, 256] in tiles of 128
    assert (scale.dtype, scale.shape) == (torch.float32, (1, 1, 2, 1))


#: Mixtral's hub names (ours, and ModelOpt's FP8 export's) for its in-memory expert names.
_MIXTRAL_HUB = {
    ".mlp.experts.": ".block_sparse_moe.experts.",
    ".mlp.gate.": ".block_sparse_moe.gate.",
}
_MIXTRAL_LEAVES = {".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}


def _hub_name(name: str) -> str:
    for old, new in _MIXTRAL_HUB.items():
        name = name.replace(old, new)
    if ".block_sparse_moe.experts." in name:
        for old, new in _MIXTRAL_LEAVES.items():
            name = name.replace(old, new)
    return name


@pytest.mark.interop
def test_mixtral_keeps_the_hub_names_modelopts_fp8_pb_wo_export_falls_back_from(
    tmp_path: Path,
) -> None:
    """ModelOpt reverses transformers' load-time renaming (the hub checkpoint's names, its FP8
    export's), but gives up on a 4-D expert scale ("Quant-aware reverse weight conversion
    skipped (experts not pre-expanded ...)") and writes the in-memory names. Ours keeps the hub
    names (``block_sparse_moe.experts.{e}.w1``, which vLLM's Mixtral loads); renamed, every
    tensor and both configs equal ModelOpt's."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    modelopt_export = pytest.importorskip("modelopt.torch.export")
    model = _model("mixtral", hidden_size=256, intermediate_size=256)  # no one-tile weight
    theirs = copy.deepcopy(model)
    ids = IDS.remainder(int(model.config.vocab_size))
    mtq.quantize(theirs, mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG, forward_loop=lambda m: m(ids))
    with pytest.warns(UserWarning, match="reverse weight conversion skipped"):
        modelopt_export.export_hf_checkpoint(theirs, export_dir=tmp_path / "modelopt")
    ref = {_hub_name(k): v for k, v in _tensors(tmp_path / "modelopt").items()}
    ours = exportlm.export_model("hf_checkpoint", quantize(model, "fp8_block"), tmp_path / "ours")
    mine = _tensors(ours)
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight_scale" in mine
    assert sorted(mine) == sorted(ref)
    for name, tensor in ref.items():
        _assert_same_tensor(name, mine[name], tensor)
    hf_quant = _configs(tmp_path / "modelopt")[0]
    excluded = [_hub_name(m + ".")[:-1] for m in hf_quant["quantization"]["exclude_modules"]]
    assert _configs(ours)[0]["quantization"]["exclude_modules"] == sorted(excluded)


@pytest.mark.interop
def test_one_tile_linears_are_the_two_differences_from_modelopt(tmp_path: Path) -> None:
    """The toy Llama (hidden 128), where every attention weight is one 128 x 128 tile:

    - shape: ModelOpt writes a one-tile scale 0-d where the quantizer's amax is one element
      (``reduce_amax`` squeezes it; Mixtral's fused gate / up halves stay ``[1, 1, 1, 1]``),
      which vLLM's loader cannot ``narrow``; ours is ``[1, 1, 1, 1]``, the shape vLLM registers;
    - value: ModelOpt's export takes a one-element amax for a per-tensor one and gives fused
      q / k / v the largest (``preprocess_linear_fusion``: ``amax.numel() == 1``), which its own
      fake-quant model did not use; ours keeps each its own, as both in-memory models compute.

    Everything else (every code, every other scale) is ModelOpt's, byte for byte."""
    model = _model()
    ref = _tensors(_modelopt_export(model, tmp_path / "modelopt"))
    ours = _tensors(exportlm.export_model("hf_checkpoint", _quantized(), tmp_path / "ours"))
    assert sorted(ours) == sorted(ref)
    differ, squeezed = set(), set()
    for name, tensor in ref.items():
        mine = ours[name]
        if mine.shape != tensor.shape:
            assert (tuple(tensor.shape), tuple(mine.shape)) == ((), (1, 1, 1, 1)), name
            squeezed.add(name)
        assert mine.dtype == tensor.dtype, name
        if not torch.equal(
            mine.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        ):
            differ.add(name)
    attention = {f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo"}
    assert squeezed == {f"{m}.weight_scale" for m in attention}
    for layer in ("model.layers.0", "model.layers.1"):
        fused = [f"{layer}.self_attn.{p}_proj.weight_scale" for p in "qkv"]
        shared = max(ours[name].reshape(()) for name in fused)
        assert all(torch.equal(ref[name], shared) for name in fused)
        own = {name for name in fused if not torch.equal(ours[name].reshape(()), shared)}
        assert own <= differ
    assert differ  # the toy's q / k / v amaxes differ
    assert all(".self_attn." in n and "o_proj" not in n for n in differ), differ


@pytest.mark.interop
@pytest.mark.parametrize("block", [128, 32])
def test_our_loader_reads_modelopts_export(block: int, tmp_path: Path) -> None:
    """ModelOpt writes any block without recording it: the loader takes it from the scales'
    shape (``in / ib``) and runs the inputs per group of that block, as ``fp8_block`` does."""
    ref = _modelopt_export(_model(**WIDE), tmp_path / "modelopt", block)
    got = _logits(load_unverified(ref))
    want = _quantized(f"fp8_block:group_size={block}", "llama", wide=True)
    torch.testing.assert_close(got, _logits(want), rtol=0, atol=LOGITS_ATOL)


@pytest.mark.interop
def test_mixed_precision_with_fp8_attention_equals_modelopts_export(tmp_path: Path) -> None:
    """``{"*": "fp8", "*.mlp.*": "fp8_block"}``: ``MIXED_PRECISION``, the MLP layers'
    ``{"quant_algo": "fp8_pb_wo"}`` (no ``group_size``) and their ``config_groups`` group
    ``{"quant_algo": "fp8_pb_wo", "targets": [...]}`` (ModelOpt 0.47 has no group fields for
    it), every tensor byte for byte (input scales within 1e-6: two calibration forwards)."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    modelopt_export = pytest.importorskip("modelopt.torch.export")
    model = _model(**WIDE)
    ids = IDS.remainder(int(model.config.vocab_size))
    block = copy.deepcopy(mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)["quant_cfg"][1]["cfg"]
    mlp = [
        {"quantizer_name": "*mlp*weight_quantizer", "cfg": block},
        {"quantizer_name": "*mlp*input_quantizer", "enable": False},
    ]
    config = {"quant_cfg": [*mtq.FP8_DEFAULT_CFG["quant_cfg"], *mlp], "algorithm": "max"}
    theirs = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(theirs, config, forward_loop=lambda m: m(ids))
        modelopt_export.export_hf_checkpoint(theirs, export_dir=tmp_path / "modelopt")
    ours_model = quantize(model, {"*": "fp8", "*.mlp.*": "fp8_block"}, calibrate=lambda m: m(ids))
    ours = exportlm.export_model("hf_checkpoint", ours_model, tmp_path / "ours")
    mine, ref = _tensors(ours), _tensors(tmp_path / "modelopt")
    assert sorted(mine) == sorted(ref)
    for name, tensor in ref.items():
        _assert_same_tensor(name, mine[name], tensor)
    assert _configs(ours) == _configs(tmp_path / "modelopt")
    layers = _configs(ours)[0]["quantization"]["quantized_layers"]
    assert layers["model.layers.0.mlp.up_proj"] == {"quant_algo": "fp8_pb_wo"}


@pytest.mark.interop
def test_inspect_passes_modelopts_export_with_its_0d_one_tile_scales(tmp_path: Path) -> None:
    ref = _modelopt_export(_model(), tmp_path / "modelopt")
    assert _tensors(ref)["model.layers.0.self_attn.o_proj.weight_scale"].shape == ()
    report = inspect_checkpoint(ref)
    assert report.errors == []
    assert report.summary["quantized_layers"] == {"fp8_block": 14}


@pytest.mark.interop
def test_inspect_warns_that_vllm_reads_no_other_tile_of_modelopts_export(tmp_path: Path) -> None:
    """ModelOpt's export in tiles of 32: its config records no tile, exportlm's loader reads it
    from the scales' shape (``test_our_loader_reads_modelopts_export``), vLLM reads 128 only:
    one warning for vLLM, no error (it was a ``block-scale-shape`` error per layer)."""
    ref = _modelopt_export(_model(**WIDE), tmp_path / "modelopt", 32)
    report = inspect_checkpoint(ref)
    assert report.errors == []
    found = [f for f in report.findings if f.rule == "fp8-pb-wo-tile-size"]
    assert [(f.severity.value, f.details["tile"], f.details["layers"]) for f in found] == [
        ("warning", 32, 14)
    ]
    assert "vLLM's ModelOpt FP8_PB_WO reads tiles of 128 x 128 only" in found[0].message
    assert "exportlm's loader (exportlm.load_exported)" in found[0].message
    assert _loaders_line(report) == (["TensorRT-LLM"], ["vLLM"])  # vLLM was listed as loading it


def _loaders_line(report: Any) -> tuple[list[str], list[str]]:
    """``quant-method-loaders``' engines that load the checkpoint, and those that fail on its
    layers' shapes."""
    (line,) = [f for f in report.findings if f.rule == "quant-method-loaders"]
    return line.details["known"], line.details["fails"]


def _retile(scale: torch.Tensor, factor: int) -> torch.Tensor:
    """``[ob, 1, ib, 1]`` tile scales as the same values in tiles ``factor`` times smaller."""
    return scale.repeat_interleave(factor, dim=0).repeat_interleave(factor, dim=2)


# ----------------------------------------------------------------------------- our layout


def test_the_cli_writes_it_by_default(tmp_path: Path) -> None:
    """``exportlm export --target hf_checkpoint --quantize fp8_block``: no ``-o format=``."""
    cmd = [sys.executable, "-m", "exportlm", "export", "--target", "hf_checkpoint", "--model"]
    cmd += ["llama", "--out", str(tmp_path / "o"), "--quantize", "fp8_block"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert _configs(tmp_path / "o")[0]["quantization"]["quant_algo"] == "fp8_pb_wo"
    scale = _tensors(tmp_path / "o")["model.layers.0.mlp.down_proj.weight_scale"]  # [128, 256]
    assert (scale.dtype, scale.shape) == (torch.float32, (1, 1, 2, 1))


def test_our_loader_reads_it_back_with_the_fake_quant_logits(tmp_path: Path) -> None:
    model = _quantized()
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "mo")
    got = _logits(exportlm.load_exported("hf_checkpoint", out))
    torch.testing.assert_close(got, _logits(model), rtol=0, atol=LOGITS_ATOL)
    # ...the inputs were quantized per group at run time (vLLM's kFp8Dynamic128Sym), not left float
    assert (got - _weight_only_logits(model)).abs().max() > 10 * LOGITS_ATOL


def test_the_streamed_export_writes_the_in_memory_bytes(tmp_path: Path) -> None:
    from tests._stream_models import assert_same_checkpoint, llama_directory

    src = llama_directory(tmp_path, tied=False)
    common = {"recipe": "fp8_block", "max_shard_size": "100KB"}
    whole = exportlm.export_model("hf_checkpoint", src, tmp_path / "whole", stream=False, **common)
    streamed = exportlm.export_model("hf_checkpoint", src, tmp_path / "str", stream=True, **common)
    assert_same_checkpoint(whole, streamed)
    assert _configs(streamed)[0]["quantization"]["quant_algo"] == "fp8_pb_wo"
    assert inspect_checkpoint(streamed).errors == []


def test_inspect_reads_the_layout_and_finds_a_wrong_tile_scale(tmp_path: Path) -> None:
    out = exportlm.export_model("hf_checkpoint", _quantized("fp8_block", wide=True), tmp_path / "o")
    report = inspect_checkpoint(out)
    assert report.errors == []
    assert report.summary["quantized_layers"] == {"fp8_block": 14}
    assert _loaders_line(report) == (["vLLM", "TensorRT-LLM"], [])  # tiles of 128: vLLM reads them
    name = "model.layers.0.mlp.down_proj.weight_scale"  # [256, 512] in tiles of 128: [2, 1, 4, 1]
    edit_checkpoint_tensors(out, {name: lambda t: t.reshape(2, 4)})  # the 2-D form vLLM takes too
    assert inspect_checkpoint(out).errors == []
    edit_checkpoint_tensors(out, {name: lambda t: t.reshape(1, 1, 8, 1)})
    found = [f for f in inspect_checkpoint(out).errors if f.subject == name]
    assert [f.rule for f in found] == ["block-scale-shape"]
    assert found[0].details["expected"] == [2, 1, 4, 1]


def test_a_hand_written_tile_of_64_is_a_vllm_warning_and_loads_here(tmp_path: Path) -> None:
    """A scale grid of 64 x 64 tiles in the ModelOpt layout (the same weights: each 128-tile
    scale repeated): exportlm's loader reads it, inspect warns for vLLM and reports no error."""
    out = exportlm.export_model("hf_checkpoint", _quantized("fp8_block", wide=True), tmp_path / "o")
    name = "model.layers.0.mlp.down_proj.weight_scale"  # [256, 512]: [2, 1, 4, 1] in 128s
    edit_checkpoint_tensors(out, {name: lambda t: _retile(t, 2)})
    report = inspect_checkpoint(out)
    assert report.errors == []
    found = [f for f in report.findings if f.rule == "fp8-pb-wo-tile-size"]
    assert [(f.subject, f.details["tile"], f.details["layers"]) for f in found] == [(name, 64, 1)]
    assert "[4, 1, 8, 1] over the weight [256, 512]" in found[0].message
    assert "-o format=compressed-tensors or -o format=finegrained-fp8" in found[0].message
    # the loaders line agrees with the warning (before: "loads in vLLM, TensorRT-LLM")
    assert _loaders_line(report) == (["TensorRT-LLM"], ["vLLM"])
    line = next(f for f in report.findings if f.rule == "quant-method-loaders").message
    assert "fails in vLLM on FP8_PB_WO tiles of 64 x 64, which it does not read" in line
    load_unverified(out)  # exportlm's loader reads the tile from the scale's shape
    edit_checkpoint_tensors(
        out, {name: lambda t: t[:3].contiguous()}
    )  # no tile grid at all: an error
    errors = [f for f in inspect_checkpoint(out).errors if f.subject == name]
    assert [(f.rule, f.details["expected"]) for f in errors] == [
        ("block-scale-shape", [2, 1, 4, 1])
    ]


def test_a_scale_of_the_wrong_shape_is_refused_by_the_loader(tmp_path: Path) -> None:
    out = exportlm.export_model("hf_checkpoint", _quantized("fp8_block", wide=True), tmp_path / "o")
    name = "model.layers.1.mlp.up_proj.weight_scale"  # [4, 1, 2, 1]
    edit_checkpoint_tensors(out, {name: lambda t: t.reshape(2, 1, 4, 1)})
    match = r"up_proj\.weight: weight_scale has shape \[2, 1, 4, 1\].*\[4, 1, 2, 1\] for vLLM"
    with pytest.raises(MalformedCheckpointError, match=match):
        load_unverified(out)


def test_an_upper_case_quant_algo_reads_as_vllm_reads_it(tmp_path: Path) -> None:
    """vLLM upper-cases ``quant_algo`` (``modelopt.py``: "ModelOpt may emit lowercase")."""
    out = exportlm.export_model("hf_checkpoint", _quantized(), tmp_path / "o")
    path = out / "hf_quant_config.json"
    config = json.loads(path.read_text())
    config["quantization"]["quant_algo"] = "FP8_PB_WO"
    path.write_text(json.dumps(config))
    (out / MANIFEST).unlink()
    torch.testing.assert_close(
        _logits(load_unverified(out)), _logits(_quantized()), rtol=0, atol=LOGITS_ATOL
    )


# ----------------------------------------------------------------------------- refusals


def test_another_block_is_refused_up_front_naming_the_layouts_that_hold_it() -> None:
    with pytest.raises(UnsupportedFormatError, match="blocks of 128 only") as info:
        check_layout(QuantRecipe.parse("fp8_block:group_size=64"), "modelopt")
    message = str(info.value)
    assert "group_size=128" in message
    assert "format=compressed-tensors" in message
    assert "format=finegrained-fp8" in message
    check_layout(QuantRecipe.parse("fp8_block"), "modelopt")  # 128: held


def test_a_model_quantized_in_another_block_is_refused_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    with pytest.raises(UnsupportedFormatError, match="blocks of 128 only"):
        exportlm.export_model(
            "hf_checkpoint", _quantized("fp8_block:group_size=64"), tmp_path / "o"
        )
    assert not (tmp_path / "o").exists()


def test_the_cli_refuses_another_block_with_exit_2(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "exportlm", "export", "--target", "hf_checkpoint", "--model"]
    cmd += ["llama", "--out", str(tmp_path / "o"), "--quantize", "fp8_block:group_size=32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "blocks of 128 only" in done.stderr
    assert "format=finegrained-fp8" in done.stderr
    assert not (tmp_path / "o").exists()


def test_inputs_no_block_divides_are_refused_naming_the_sizes_that_would() -> None:
    """192 input features: 128 does not divide them; 64 and 32 do, in a layout that records the
    block (the ModelOpt layout holds 128 only)."""
    model = tiny_hf_model("llama", seed=0, hidden_size=192, intermediate_size=384)
    with pytest.raises(UnsupportedFormatError, match="needs input features divisible by 128") as e:
        quantize(model, "fp8_block")
    message = str(e.value)
    assert "group_size=64 or group_size=32 divides 192" in message
    assert "the ModelOpt layout holds fp8_block in blocks of 128 only" in message
    assert not any(type(m).__name__.startswith("Quant") for m in model.modules())  # nothing done


# ----------------------------------------------------------------------------- vLLM


_VLLM_PARSE = """
import json, sys
from vllm.model_executor.layers.quantization.modelopt import ModelOptFp8Config, resolve
out = {}
for name, section in (("hf_quant", json.load(open(sys.argv[1]))),
                      ("config", json.load(open(sys.argv[2]))["quantization_config"])):
    config = ModelOptFp8Config.from_config(section)
    spec, _, _ = resolve(config.quant_method, config, "model.layers.0.mlp.down_proj")
    out[name] = {"name": config.get_name(), "algo": config.quant_method,
                 "blocked": config.has_blocked_weights(), "excluded": config.exclude_modules,
                 "weight": str(spec.weight), "inputs": str(spec.activation)}
print(json.dumps(out))
"""


def test_vllm_reads_the_config_as_block_weights_with_per_group_dynamic_inputs(
    tmp_path: Path,
) -> None:
    """vLLM's FP8 block kernels need AMX or a GPU; its config class parses on any CPU."""
    python = _vllm_python()
    out = exportlm.export_model("hf_checkpoint", _quantized(), tmp_path / "o")
    cmd = [python, "-c", _VLLM_PARSE, str(out / "hf_quant_config.json"), str(out / "config.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    for got in parsed.values():
        assert (got["name"], got["algo"], got["blocked"]) == ("modelopt", "FP8_PB_WO", True)
        assert got["excluded"] == ["lm_head", "model.embed_tokens"]
        assert "static,GroupShape(row=128, col=128)" in got["weight"]
        # inputs: per token and group of 128, at run time: fp8_block's fp8_group inputs
        assert "dynamic,GroupShape(row=1, col=128)" in got["inputs"]
