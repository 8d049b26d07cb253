"""``mxfp4`` as openai/gpt-oss ships it: ``format="gpt-oss-mxfp4"``.

``config.json``'s ``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert":
[...]}``; each GptOss experts module stores ``gate_up_proj_blocks`` (uint8 ``[E, 2I, H / 32,
16]``, two E2M1 codes a byte, the even column low) with ``gate_up_proj_scales`` (uint8 E8M0
``[E, 2I, H / 32]``), the same for ``down_proj``, and the biases as they are; every other
module stays in float (transformers' Mxfp4 quantizer replaces only ``GptOssMLP``'s experts,
vLLM's ``Mxfp4Config`` leaves every linear unquantized). The codes are those of our
ModelOpt-layout ``mxfp4`` export; transformers (CPU: its dequantize path) and our loader read
the checkpoint back with the fake-quant logits, vLLM's config classes parse it, the stream
writes the same bytes, and what the layout cannot hold is refused before any work.
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
from exportlm.errors import MalformedCheckpointError, UnsupportedFormatError
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import QuantRecipe, check_layout, quantize
from tests._fake_quant import edit_checkpoint_tensors, load_unverified
from tests._fake_quant import logits as _logits
from tests._vllm import vllm_python as _vllm_python
from tests.test_interop import _tensors

GO = "gpt-oss-mxfp4"
#: The fake-quant model against a loader of the same dequantized weights (float32): measured
#: 2.4e-7 (transformers) and 2.4e-7 (ours) on the toy gpt_oss; room for another BLAS' order.
LOGITS_ATOL = 1e-4
ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "exportlm-manifest.json"

#: openai/gpt-oss-20b's ``quantization_config`` as published (wildcard module names).
OPENAI = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
LAYERS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


@functools.cache
def _quantized(family: str = "gpt_oss") -> nn.Module:
    """The toy quantized as the layout holds it (the recipe made for it: its experts only)."""
    recipe = QuantRecipe.parse("mxfp4").for_layout(GO)
    return quantize(tiny_hf_model(family, seed=0).eval(), recipe)


def _export(tmp_path: Path, format: str = GO) -> Path:
    out: Path = exportlm.export_model(
        "hf_checkpoint", _quantized(), tmp_path / format, format=format
    )
    return out


def _config(out: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((out / "config.json").read_text())["quantization_config"]
    return config


def _fake_quant_experts(model: nn.Module, layer: str, projection: str) -> torch.Tensor:
    """The experts' fake-quantized weight as the model's parameter stores it (``[E, in, out]``)."""
    experts: Any = model.get_submodule(layer)
    canonical = experts.weight_quantizer_of(projection)(experts.canonical_weight(projection))
    return canonical.transpose(-1, -2)


# ----------------------------------------------------------------------------- the layout


def test_the_config_and_tensors_are_what_gpt_oss_ships(tmp_path: Path) -> None:
    out = _export(tmp_path)
    config = _config(out)
    assert config["quant_method"] == "mxfp4"
    assert set(config) == {"quant_method", "modules_to_not_convert"}
    assert {"lm_head", "model.embed_tokens", "model.layers.0.self_attn.q_proj"} <= set(
        config["modules_to_not_convert"]
    )
    assert not any("experts" in m for m in config["modules_to_not_convert"])
    assert not (out / "hf_quant_config.json").exists()
    tensors, model = _tensors(out), tiny_hf_model("gpt_oss", seed=0).eval()
    hidden, inter, experts = 128, 128, 4
    for layer in LAYERS:
        for projection, (rows, cols) in {
            "gate_up_proj": (2 * inter, hidden),
            "down_proj": (hidden, inter),
        }.items():
            blocks = tensors.pop(f"{layer}.{projection}_blocks")
            scales = tensors.pop(f"{layer}.{projection}_scales")
            assert (blocks.dtype, tuple(blocks.shape)) == (
                torch.uint8,
                (experts, rows, cols // 32, 16),
            )
            assert (scales.dtype, tuple(scales.shape)) == (torch.uint8, (experts, rows, cols // 32))
            assert f"{layer}.{projection}" not in tensors
    # everything else is the model's own tensor, bit for bit (biases, router, attention)
    assert set(tensors) == set(model.state_dict()) - {
        f"{layer}.{p}" for layer in LAYERS for p in ("gate_up_proj", "down_proj")
    }
    for name, tensor in tensors.items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_the_codes_are_the_modelopt_layouts_mxfp4_codes(tmp_path: Path) -> None:
    """Byte for byte the codes and scales the ModelOpt layout writes per expert, gate / up rows
    interleaved as GptOss' ``gate_up_proj`` stores them."""
    ours, theirs = _tensors(_export(tmp_path)), _tensors(_export(tmp_path, "modelopt"))
    for layer in LAYERS:
        for projection, linears in {
            "gate_up_proj": ("gate_proj", "up_proj"),
            "down_proj": ("down_proj",),
        }.items():
            per_leaf = {}
            for leaf in ("weight", "weight_scale"):
                split = [
                    torch.stack([theirs[f"{layer}.{e}.{linear}.{leaf}"] for e in range(4)])
                    for linear in linears
                ]  # [E, I, ...] each; interleave gate0, up0, gate1, ...
                per_leaf[leaf] = torch.stack(split, dim=2).flatten(1, 2)
            blocks = ours[f"{layer}.{projection}_blocks"]
            assert torch.equal(blocks.flatten(-2), per_leaf["weight"])
            assert torch.equal(ours[f"{layer}.{projection}_scales"], per_leaf["weight_scale"])


def test_transformers_dequantization_is_the_fake_quant_weight_exactly(tmp_path: Path) -> None:
    """transformers' own reader of the bytes (``convert_moe_packed_tensors``: its LUT, nibble
    order and ``scale - 127``) gives our fake-quantized experts exactly (a pure function of
    the codes and scales)."""
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = _tensors(_export(tmp_path))
    for layer in LAYERS:
        for projection in ("gate_up_proj", "down_proj"):
            got = convert_moe_packed_tensors(
                tensors[f"{layer}.{projection}_blocks"],
                tensors[f"{layer}.{projection}_scales"],
                dtype=torch.float32,
            )
            want = _fake_quant_experts(_quantized(), layer, projection)
            assert torch.equal(got, want), (layer, projection)


def test_our_loader_reads_it_back_with_the_fake_quant_logits(tmp_path: Path) -> None:
    got = _logits(exportlm.load_exported("hf_checkpoint", _export(tmp_path)))
    torch.testing.assert_close(got, _logits(_quantized()), rtol=0, atol=LOGITS_ATOL)
    # ...and the experts were quantized: the float model is far off
    assert (got - _logits(tiny_hf_model("gpt_oss", seed=0).eval())).abs().max() > 1e-2


def test_transformers_loads_it_on_cpu_by_dequantizing(tmp_path: Path) -> None:
    """Without triton >= 3.5 and the kernels package (no GPU here) transformers' Mxfp4
    quantizer dequantizes (quantizer_mxfp4.py ``validate_environment``): GptOssExperts with
    float weights, the fake-quant model's."""
    transformers = pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("a GPU: transformers would run its triton MXFP4 kernels")
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    out = _export(tmp_path)
    config = AUTO_QUANTIZATION_CONFIG_MAPPING["mxfp4"].from_dict(_config(out))
    assert type(config) is transformers.Mxfp4Config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "GptOssExperts"
    want = _fake_quant_experts(_quantized(), LAYERS[0], "gate_up_proj")
    assert torch.equal(experts.gate_up_proj.detach(), want)
    # the same dequantized weights, float32: measured 2.4e-7
    torch.testing.assert_close(_logits(model), _logits(_quantized()), rtol=0, atol=LOGITS_ATOL)


def test_the_streamed_export_writes_the_in_memory_bytes(tmp_path: Path) -> None:
    from tests._stream_models import assert_same_checkpoint, family_directory

    src = family_directory(tmp_path, "gpt_oss")  # bfloat16
    common = {"recipe": "mxfp4", "format": GO, "max_shard_size": "100KB"}
    whole = exportlm.export_model("hf_checkpoint", src, tmp_path / "whole", stream=False, **common)
    streamed = exportlm.export_model("hf_checkpoint", src, tmp_path / "str", stream=True, **common)
    assert_same_checkpoint(whole, streamed)
    assert _config(streamed)["quant_method"] == "mxfp4"
    assert json.loads((streamed / MANIFEST).read_text())["options"]["format"] == GO
    assert inspect_checkpoint(streamed).errors == []


def test_inspect_reads_the_layout_and_finds_a_wrong_scale_shape(tmp_path: Path) -> None:
    out = _export(tmp_path)
    report = inspect_checkpoint(out)
    assert report.errors == []
    assert (report.summary["layout"], report.summary["quantized_layers"]) == (GO, {"mxfp4": 4})
    name = f"{LAYERS[0]}.down_proj_scales"
    edit_checkpoint_tensors(out, {name: lambda t: t[:, :, :2].contiguous()})
    found = [f for f in inspect_checkpoint(out).errors if f.subject == name]
    assert [f.rule for f in found] == ["block-scale-shape"]
    assert found[0].details["expected"] == [4, 128, 4]


def test_a_checkpoint_with_openais_config_reads_the_same(tmp_path: Path) -> None:
    """openai/gpt-oss-20b's ``quantization_config`` as published (wildcard module names), no
    manifest: our loader, transformers and inspect read it as ours."""
    transformers = pytest.importorskip("transformers")
    out = _export(tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = OPENAI
    (out / "config.json").write_text(json.dumps(config))
    (out / MANIFEST).unlink()
    want = _logits(_quantized())
    torch.testing.assert_close(_logits(load_unverified(out)), want, rtol=0, atol=LOGITS_ATOL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logits(theirs), want, rtol=0, atol=LOGITS_ATOL)
    report = inspect_checkpoint(out)
    assert report.errors == []
    assert report.summary["quantized_layers"] == {"mxfp4": 4}


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("recipe", ["fp8", "mxfp8", "nvfp4", "int4_awq", "mxfp4+fp8_kv"])
def test_other_recipes_are_refused_before_any_work_naming_the_layouts(recipe: str) -> None:
    with pytest.raises(UnsupportedFormatError, match=r"format=modelopt|format='modelopt'") as info:
        check_layout(QuantRecipe.parse(recipe).for_layout(GO), GO)
    assert GO not in str(info.value).split(";", 1)[-1]  # the layouts named are the ones holding it


def test_mxfp4_names_the_three_layouts_that_hold_it() -> None:
    with pytest.raises(UnsupportedFormatError, match=rf"modelopt.*compressed-tensors.*{GO}"):
        check_layout(QuantRecipe.parse("mxfp4"), "finegrained-fp8")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "llama4"])
def test_other_models_are_refused_and_nothing_is_written(family: str, tmp_path: Path) -> None:
    """Both loaders read the layout for gpt-oss only (transformers replaces ``GptOssMLP``'s
    experts, vLLM's ``GptOssMxfp4Config`` matches ``model_type: gpt_oss``)."""
    model = quantize(tiny_hf_model(family, seed=0).eval(), "mxfp4")
    with pytest.raises(UnsupportedFormatError, match=r"gpt_oss models only.*format=modelopt"):
        exportlm.export_model("hf_checkpoint", model, tmp_path / "out", format=GO)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("recipe", "match"),
    [
        ("mxfp4", r"quantizes model\.layers\.0\.self_attn"),  # attention too: no names for it
        ({"*.mlp.experts": "mxfp4", "model.layers.1.*": None}, r"leaves model\.layers\.1\.mlp"),
    ],
)
def test_a_model_quantizing_other_modules_or_not_every_expert_is_refused(
    recipe: Any, match: str, tmp_path: Path
) -> None:
    """vLLM's ``Mxfp4Config`` reads every experts module as MXFP4 and every linear as float."""
    model = quantize(tiny_hf_model("gpt_oss", seed=0).eval(), recipe)
    with pytest.raises(UnsupportedFormatError, match=match):
        exportlm.export_model("hf_checkpoint", model, tmp_path / "out", format=GO)
    assert not (tmp_path / "out").exists()


def test_a_model_directory_of_another_type_is_refused_before_its_weights_are_read(
    tmp_path: Path,
) -> None:
    from tests._stream_models import family_directory

    src = family_directory(tmp_path, "llama")
    for shard in src.glob("*.safetensors"):
        shard.write_bytes(b"not a safetensors file")  # read, it would fail differently
    for stream in (False, True):
        with pytest.raises(UnsupportedFormatError, match="gpt_oss models only"):
            exportlm.export_model(
                "hf_checkpoint", src, tmp_path / "o", recipe="mxfp4", format=GO, stream=stream
            )
    assert not (tmp_path / "o").exists()


def test_the_cli_refuses_another_model_with_exit_2(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "exportlm", "export", "--target", "hf_checkpoint", "--model"]
    cmd += ["llama", "--out", str(tmp_path / "o"), "--quantize", "mxfp4", "-o", f"format={GO}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "model_type 'llama'" in done.stderr
    assert "format=modelopt" in done.stderr
    assert "quantized" not in done.stderr  # refused before quantizing
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- reading garbage


def test_a_nan_scale_and_misshapen_blocks_are_refused_naming_them(tmp_path: Path) -> None:
    out = _export(tmp_path)
    name = f"{LAYERS[0]}.gate_up_proj_scales"
    edit_checkpoint_tensors(out, {name: lambda t: torch.full_like(t, 255)})
    with pytest.raises(MalformedCheckpointError, match=rf"{name} holds .* E8M0 NaN"):
        load_unverified(out)
    out = _export(tmp_path / "again")
    name = f"{LAYERS[1]}.down_proj_blocks"
    edit_checkpoint_tensors(out, {name: lambda t: t[:, :, :3].contiguous()})
    with pytest.raises(MalformedCheckpointError, match=rf"{name} has shape \[4, 128, 3, 16\]"):
        load_unverified(out)


def test_blocks_under_a_module_that_is_no_experts_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    out = _export(tmp_path)
    layer = LAYERS[0]
    (out / MANIFEST).unlink()

    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    for leaf in ("blocks", "scales"):  # move one projection under the attention module
        tensors[f"model.layers.0.self_attn.gate_up_proj_{leaf}"] = tensors.pop(
            f"{layer}.gate_up_proj_{leaf}"
        )
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(MalformedCheckpointError, match="not a stacked experts module"):
        load_unverified(out)


# ----------------------------------------------------------------------------- the engines


_VLLM_PARSE = """
import json, sys, types
from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config, Mxfp4Config
config = json.load(open(sys.argv[1]))
section = config["quantization_config"]
hf_config = types.SimpleNamespace(model_type=config["model_type"])
other = types.SimpleNamespace(model_type="llama")
parsed = GptOssMxfp4Config.from_config(section)
print(json.dumps({
    "override": GptOssMxfp4Config.override_quantization_method(section, None, hf_config),
    "other_model": GptOssMxfp4Config.override_quantization_method(section, None, other),
    "name": parsed.get_name(), "base": Mxfp4Config.from_config(section).get_name(),
    "ignored": parsed.ignored_layers,
}))
"""


def test_vllm_mxfp4_config_parses_it_for_gpt_oss_only(tmp_path: Path) -> None:
    """Parsing only: vLLM's CPU MXFP4 experts need AMX tiles, this CPU has none."""
    out = _export(tmp_path)
    done = subprocess.run(
        [_vllm_python(), "-c", _VLLM_PARSE, str(out / "config.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == {
        "override": "gpt_oss_mxfp4",
        "other_model": None,  # why the layout refuses other models
        "name": "gpt_oss_mxfp4",
        "base": "mxfp4",
        "ignored": None,  # modules_to_not_convert is not read: every linear stays float
    }


def test_the_engine_tables_name_it(tmp_path: Path) -> None:
    from exportlm.engines import Verdict, artifact_kind, get_engine

    kind = artifact_kind(_export(tmp_path))
    assert (kind.layout, kind.scheme, kind.model_type) == ("mxfp4", "MXFP4", "gpt_oss")
    row = (kind.target, kind.layout, kind.scheme)
    vllm = get_engine("vllm")
    on_gpu = vllm.support(*row, device="cuda", dtype="bfloat16", model_type=kind.model_type)
    assert on_gpu.verdict is Verdict.RUNS
    no_amx = vllm.support(*row, dtype="bfloat16", model_type="gpt_oss", cpu_features=frozenset())
    assert no_amx.verdict is Verdict.ENGINE_LIMIT
    assert "AMX" in no_amx.reason
    # transformers 5.19 (the engine's venv, without accelerate) raises before its CPU fallback
    transformers = get_engine("transformers")
    on_cpu = transformers.support(*row, dtype="float32", model_type=kind.model_type)
    assert on_cpu.verdict is Verdict.ENGINE_LIMIT
    assert "Accelerate" in on_cpu.reason


# ----------------------------------------------------------------------------- the CLI


def test_the_cli_exports_only_the_experts(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "exportlm", "export", "--target", "hf_checkpoint"]
    cmd += ["--model", "gpt_oss", "--out", str(out), "--quantize", "mxfp4", "-o", f"format={GO}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "quantizes only *.mlp.experts" in done.stderr
    assert _config(out)["quant_method"] == "mxfp4"
    report = inspect_checkpoint(out)
    assert report.errors == []
    assert report.summary["quantized_layers"] == {"mxfp4": 4}
