"""W4A8 (recipe ``w4a8_awq``): INT4 AWQ weights run as FP8, FP8 static per-tensor inputs.

ModelOpt's ``W4A8_AWQ`` through the public API: quantize, the ModelOpt-layout checkpoint
(names, dtypes, shapes, configs), the loader against the fake-quantized model, the
``group_size`` option, the refusals of compressed-tensors and ONNX, ``inspect`` and its
``w4a8-fp8-range`` rule, the CLI. Against ModelOpt 0.47 on CPU (``interop``): the same
names, dtypes, shapes and configs, and the bytes of every linear both search alone.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import exportlm
from exportlm.cli import main
from exportlm.errors import InvalidModelError, UnsupportedFormatError
from exportlm.inspection import Severity, inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize
from exportlm.stream import export_streaming
from tests._fake_quant import checkpoint_tensors as _tensors
from tests._stream_models import assert_same_checkpoint, in_memory_export, llama_directory

FP8_MAX = 448.0


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def _quantized(family: str = "llama", recipe: str = "w4a8_awq", **overrides: Any) -> Any:
    model = tiny_hf_model(family.removesuffix("_mha"), seed=0, **overrides).eval()
    model.config.architectures = [type(model).__name__]  # ModelOpt reads it
    batch = _batch(model.config.vocab_size)
    original = copy.deepcopy(model)

    def calibrate(m: Any) -> None:
        with torch.no_grad():
            m(batch)

    quantize(model, recipe, calibrate=calibrate)
    return model, original, batch, calibrate


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, torch.Tensor, Path]:
    model, _, batch, _ = _quantized()
    out = exportlm.export_model("hf_checkpoint", model, tmp_path_factory.mktemp("w4a8") / "ckpt")
    return model, batch, Path(out)


def test_the_checkpoint_is_modelopts_w4a8_awq_layout(
    exported: tuple[Any, torch.Tensor, Path],
) -> None:
    _, _, out = exported
    declared = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert declared["quant_algo"] == "W4A8_AWQ"
    assert (declared["group_size"], declared["has_zero_point"], declared["pre_quant_scale"]) == (
        128,
        False,
        True,
    )
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["quant_algo"]) == ("modelopt", "W4A8_AWQ")
    assert "config_groups" not in config  # ModelOpt 0.47 writes none for W4A8_AWQ
    tensors = _tensors(out)
    layer = "model.layers.0."
    q = tensors[layer + "self_attn.q_proj.weight"]
    assert (q.dtype, tuple(q.shape)) == (torch.uint8, (64, 128))  # [out / 2, in]: two codes a byte
    scale = tensors[layer + "self_attn.q_proj.weight_scale"]
    assert (scale.dtype, tuple(scale.shape)) == (torch.float32, (128, 1))  # [out, in / 128]
    for name in ("weight_scale_2", "input_scale"):
        leaf = tensors[layer + "self_attn.q_proj." + name]
        assert (leaf.dtype, leaf.shape) == (torch.float32, torch.Size([]))
    # the AWQ scales of norm-fed linears are folded into the norm; o_proj / down_proj keep theirs
    assert layer + "self_attn.q_proj.pre_quant_scale" not in tensors
    assert tensors[layer + "mlp.down_proj.pre_quant_scale"].shape == (256,)
    # one FP8 second level per fused GEMM, and each INT4 value fits FP8 after it
    for fused in (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
    ):
        seconds = {float(tensors[f"{layer}{p}.weight_scale_2"]) for p in fused}
        assert len(seconds) == 1, fused
        peak = max(float(tensors[f"{layer}{p}.weight_scale"].max()) for p in fused) * 7
        assert peak / seconds.pop() == pytest.approx(FP8_MAX, rel=1e-5)


def test_the_loaded_checkpoint_computes_the_fake_quantized_model(
    exported: tuple[Any, torch.Tensor, Path],
) -> None:
    model, batch, out = exported
    with torch.no_grad():
        expected = model(batch).logits
    runtime = exportlm.load_exported("hf_checkpoint", out)
    got = torch.as_tensor(runtime(batch))
    # the same dequantized weights and input scales: float noise of the two forwards only
    torch.testing.assert_close(got, expected, rtol=0.0, atol=1e-5)


def test_weights_are_int4_values_rounded_to_fp8(exported: tuple[Any, torch.Tensor, Path]) -> None:
    """The fake-quantized weight is ``fp8(int4 value / weight_scale_2) * weight_scale_2``:
    on the FP8 grid of the second scale, and not the plain INT4 value everywhere."""
    model, _, out = exported
    tensors = _tensors(out)
    linear = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        fake = linear.weight_quantizer(linear.weight / linear.input_quantizer.pre_quant_scale)
    s2 = tensors["model.layers.0.mlp.down_proj.weight_scale_2"]
    # on the grid: rounding to FP8 at that scale gives it back (``fake / s2`` itself is an
    # FP8 value up to the division's rounding, which depends on s2's bits)
    regrid = (fake / s2).to(torch.float8_e4m3fn).to(torch.float32) * s2
    assert torch.equal(regrid, fake)
    packed = tensors["model.layers.0.mlp.down_proj.weight"]
    low = (packed << 4).view(torch.int8) >> 4
    high = packed.view(torch.int8) >> 4
    codes = torch.stack((low, high), dim=1).reshape(fake.shape).float()
    group = tensors["model.layers.0.mlp.down_proj.weight_scale"]
    int4 = (codes.reshape(*fake.shape[:-1], -1, 128) * group.unsqueeze(-1)).reshape(fake.shape)
    assert not torch.equal(int4, fake)  # the FP8 step rounds some values
    torch.testing.assert_close(fake, int4, rtol=2**-3, atol=float(s2) * 2**-6)


def test_group_size_option(tmp_path: Path) -> None:
    model, _, _, _ = _quantized(recipe="w4a8_awq:group_size=64")
    out = Path(exportlm.export_model("hf_checkpoint", model, tmp_path / "g64"))
    declared = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert declared["group_size"] == 64
    scale = _tensors(out)["model.layers.0.self_attn.o_proj.weight_scale"]
    assert tuple(scale.shape) == (128, 2)


def test_compressed_tensors_and_onnx_refuse_it(tmp_path: Path) -> None:
    model, _, _, _ = _quantized()
    with pytest.raises(UnsupportedFormatError, match="format='modelopt'"):
        exportlm.export_model("hf_checkpoint", model, tmp_path / "ct", format="compressed-tensors")
    assert not (tmp_path / "ct").exists()
    with pytest.raises(InvalidModelError, match="w4a8_awq"):
        exportlm.export_model("onnx", model, tmp_path / "model.onnx")
    assert not (tmp_path / "model.onnx").exists()


def test_stacked_experts_are_refused_before_anything_changes() -> None:
    """Mixtral's fused experts apply the per-expert AWQ scale and the FP8 input quantizer in
    an order their loader does not (measured: logits 0.04 apart): refused, nothing converted."""
    model = tiny_hf_model("mixtral", seed=0).eval()
    with pytest.raises(UnsupportedFormatError, match=r"w4a8_awq.*per-expert AWQ scale"):
        quantize(model, "w4a8_awq")
    assert type(model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"


def test_inspect_passes_it(exported: tuple[Any, torch.Tensor, Path]) -> None:
    _, _, out = exported
    assert main(["inspect", str(out)]) == 0
    report = inspect_checkpoint(out)
    assert dict(report.summary["quantized_layers"]) == {"w4a8": 14}


def test_inspect_flags_a_second_scale_that_clips_the_fp8_weights(
    exported: tuple[Any, torch.Tensor, Path], tmp_path: Path
) -> None:
    """NVFP4's ``amax / (6 * 448)`` as the second scale: TensorRT-LLM would clip silently."""
    _, _, out = exported
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in out.iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    shard = next(bad.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.1.mlp.down_proj.weight_scale_2"
    tensors[name] = tensors[name] / 6
    save_file(tensors, shard, metadata={"format": "pt"})
    (bad / "manifest.json").unlink(missing_ok=True)
    errors = inspect_checkpoint(bad).by_severity(Severity.ERROR)
    assert [(f.rule, f.subject) for f in errors] == [("w4a8-fp8-range", name)]
    assert main(["inspect", str(bad)]) == 1


def test_cli_quantize_w4a8_awq(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    argv = ["export", "--target", "hf_checkpoint", "--model", "llama", "--out", str(out)]
    assert main([*argv, "--quantize", "w4a8_awq", "--verify"]) == 0
    declared = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert declared["quant_algo"] == "W4A8_AWQ"


def test_the_streamed_export_is_the_in_memory_one_byte_for_byte(tmp_path: Path) -> None:
    """Layer by layer (a bf16 model directory, float calibration inputs): the same files."""
    src = llama_directory(tmp_path, tied=False)
    expected = in_memory_export(src, tmp_path / "memory", "w4a8_awq", shard="100KB")
    streamed = export_streaming(
        src,
        tmp_path / "streamed",
        recipe="w4a8_awq",
        max_shard_size="100KB",
        calibration_inputs="float",
    )
    assert_same_checkpoint(expected, streamed)


# ------------------------------------------------------------------------------ ModelOpt parity


def _both(family: str, tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    mtq = pytest.importorskip("modelopt.torch.quantization")
    modelopt_export = pytest.importorskip("modelopt.torch.export")
    overrides = {"num_key_value_heads": 4} if family == "llama_mha" else {}
    # W4A8_AWQ_BETA_CFG runs awq_lite, which searches no clip
    model, theirs, _, calibrate = _quantized(family, "w4a8_awq:clip=false", **overrides)
    ours = exportlm.export_model("hf_checkpoint", model, tmp_path / "ours")
    mtq.quantize(theirs, mtq.W4A8_AWQ_BETA_CFG, forward_loop=calibrate)
    modelopt_export.export_hf_checkpoint(theirs, export_dir=tmp_path / "modelopt")
    for name in ("hf_quant_config.json", "config.json"):
        _assert_same_config(Path(ours), tmp_path / "modelopt", name)
    return _tensors(Path(ours)), _tensors(tmp_path / "modelopt")


def _assert_same_config(ours: Path, ref: Path, name: str) -> None:
    def read(directory: Path) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((directory / name).read_text())
        section = data if name == "hf_quant_config.json" else data["quantization_config"]
        section.pop("producer")
        quantization = section.get("quantization", section)
        listed = "exclude_modules" if "exclude_modules" in quantization else "ignore"
        quantization[listed].sort()
        return section

    assert read(ours) == read(ref), name


@pytest.mark.interop
@pytest.mark.parametrize("family", ["llama", "llama_tied", "llama_mha"])
def test_checkpoint_matches_modelopts_export(family: str, tmp_path: Path) -> None:
    """Names, dtypes, shapes and configs equal. ``o_proj`` / ``down_proj`` are searched
    alone by both (ModelOpt's ``awq_lite`` grid and loss on the INT4 stage, the FP8 step
    switched off as its ``convert_to_single_quantizer`` does): their codes are the same
    bytes and their scales agree within float noise. Fused groups differ where the
    searches do (ours is joint, ModelOpt averages), as for ``int4_awq``."""
    ours, ref = _both(family, tmp_path)
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        assert (ours[name].dtype, ours[name].shape) == (tensor.dtype, tensor.shape), name
    alone = [n for n in ref if n.rsplit(".", 2)[-2] in ("o_proj", "down_proj")]
    assert len(alone) == 4 * 5  # two layers, two linears, five leaves each
    for name in alone:
        if name.endswith(".weight"):
            assert torch.equal(ours[name], ref[name]), name
        else:
            torch.testing.assert_close(ours[name], ref[name], rtol=1e-6, atol=0.0, msg=name)
