"""``fp8_block`` in DeepSeek-V3's / Qwen3-FP8's own layout: ``format="finegrained-fp8"``.

``config.json``'s ``quantization_config = {"quant_method": "fp8", "activation_scheme":
"dynamic", "weight_block_size": [b, b], "modules_to_not_convert": [...]}`` and per quantized
linear ``weight`` (float8_e4m3fn) with ``weight_scale_inv`` (float32 ``[ceil(out / b), in / b]``,
the dequantization multiplier: the same numbers as compressed-tensors' ``weight_scale``).
Written in memory and streamed, read back by our loader (ours and a hand-built
DeepSeek-style checkpoint), by transformers (CPU: its dequantize path) and parsed by vLLM's
``Fp8Config``; garbage and inconsistent configs refused; the CLI and the real model.
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
from tests._fake_quant import IDS, edit_checkpoint_tensors, load_unverified
from tests._fake_quant import logits as _logits
from tests._fake_quant import quant_linears as _linears
from tests._vllm import vllm_python as _vllm_python
from tests.test_interop import _tensors

FG = "finegrained-fp8"
CT = "compressed-tensors"
#: Our loader against the fake-quant model: the same dequantized weights and per-group inputs
#: (measured 0.0 on the toy Llama; the bound leaves room for another BLAS' summation order).
LOGITS_ATOL = 1e-4
ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "exportlm-manifest.json"


@functools.cache
def _quantized(recipe: str = "fp8_block", family: str = "llama") -> nn.Module:
    return quantize(tiny_hf_model(family, seed=0).eval(), recipe)


def _export(tmp_path: Path, recipe: str = "fp8_block", format: str = FG, name: str = "") -> Path:
    out: Path = exportlm.export_model(
        "hf_checkpoint", _quantized(recipe), tmp_path / (name or format), format=format
    )
    return out


def _config(out: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((out / "config.json").read_text())["quantization_config"]
    return config


def _weight_only_logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    """The fake-quant model with its inputs left in float (what a dequantizing loader computes):
    every input quantizer off, the linears' and the experts' projections'."""
    from exportlm.quant import TensorQuantizer

    inputs = [
        module
        for name, module in model.named_modules()
        if isinstance(module, TensorQuantizer) and "input" in name.rpartition(".")[2]
    ]
    for quantizer in inputs:
        quantizer.enabled = False
    try:
        return _logits(model, ids)
    finally:
        for quantizer in inputs:
            quantizer.enabled = True


# ----------------------------------------------------------------------------- the layout


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_block:group_size=32"])
def test_the_config_is_what_transformers_and_vllm_read(recipe: str, tmp_path: Path) -> None:
    out = _export(tmp_path, recipe)
    block = 32 if "32" in recipe else 128
    assert _config(out) == {
        "activation_scheme": "dynamic",
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
        "quant_method": "fp8",
        "weight_block_size": [block, block],
    }
    assert not (out / "hf_quant_config.json").exists()
    tensors = _tensors(out)
    for name, module in _linears(_quantized(recipe)).items():
        rows, cols = module.weight.shape
        assert tensors[f"{name}.weight"].dtype == torch.float8_e4m3fn
        scale = tensors[f"{name}.weight_scale_inv"]
        assert (scale.dtype, scale.shape) == (torch.float32, (-(-rows // block), cols // block))
        assert f"{name}.weight_scale" not in tensors
        assert f"{name}.input_scale" not in tensors


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_block:group_size=32"])
def test_the_bytes_are_compressed_tensors_codes_and_scales_renamed(
    recipe: str, tmp_path: Path
) -> None:
    ours, theirs = _tensors(_export(tmp_path, recipe)), _tensors(_export(tmp_path, recipe, CT))
    renamed = {k.replace(".weight_scale_inv", ".weight_scale"): v for k, v in ours.items()}
    assert set(renamed) == set(theirs)
    for name, tensor in renamed.items():
        other = theirs[name]
        assert (tensor.dtype, tensor.shape) == (other.dtype, other.shape), name
        assert torch.equal(
            tensor.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)
        )


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_block:group_size=32"])
def test_our_loader_reads_it_back_with_the_fake_quant_logits(recipe: str, tmp_path: Path) -> None:
    model = _quantized(recipe)
    got = _logits(exportlm.load_exported("hf_checkpoint", _export(tmp_path, recipe)))
    torch.testing.assert_close(got, _logits(model), rtol=0, atol=LOGITS_ATOL)
    # ...the inputs were quantized per group at run time, as the fake-quant model does
    assert (got - _weight_only_logits(model)).abs().max() > 10 * LOGITS_ATOL


def test_moe_experts_load_back_with_the_fake_quant_logits(tmp_path: Path) -> None:
    """Qwen3-MoE's fused experts are written as per-expert linears (the layout has no stacked names)."""
    model = _quantized("fp8_block:group_size=32", "qwen3_moe")
    ids = IDS.remainder(int(model.config.vocab_size))
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "moe", format=FG)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv" in _tensors(out)
    assert inspect_checkpoint(out).errors == []
    got = _logits(exportlm.load_exported("hf_checkpoint", out), ids)
    torch.testing.assert_close(got, _logits(model, ids), rtol=0, atol=LOGITS_ATOL)


def test_the_streamed_export_writes_the_in_memory_bytes(tmp_path: Path) -> None:
    from tests._stream_models import assert_same_checkpoint, llama_directory

    src = llama_directory(tmp_path, tied=False)
    common = {"recipe": "fp8_block:group_size=64", "format": FG, "max_shard_size": "100KB"}
    whole = exportlm.export_model("hf_checkpoint", src, tmp_path / "whole", stream=False, **common)
    streamed = exportlm.export_model("hf_checkpoint", src, tmp_path / "str", stream=True, **common)
    assert_same_checkpoint(whole, streamed)
    assert _config(streamed)["weight_block_size"] == [64, 64]
    assert json.loads((streamed / MANIFEST).read_text())["options"]["format"] == FG
    assert inspect_checkpoint(streamed).errors == []


def test_inspect_reads_the_layout_and_finds_a_wrong_tile_scale(tmp_path: Path) -> None:
    out = _export(tmp_path)
    report = inspect_checkpoint(out)
    assert report.errors == []
    assert (report.summary["layout"], report.summary["quantized_layers"]) == (FG, {"fp8_block": 14})
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    edit_checkpoint_tensors(out, {name: lambda t: torch.cat([t, t])})
    found = [f for f in inspect_checkpoint(out).errors if f.subject == name]
    assert [f.rule for f in found] == ["block-scale-shape"]
    assert found[0].details["expected"] == [1, 1]


# ----------------------------------------------------------------------------- refusals at export


@pytest.mark.parametrize("recipe", ["fp8", "int4_awq", "nvfp4", "fp8_block+fp8_kv"])
def test_other_recipes_are_refused_before_any_work_naming_the_layouts(recipe: str) -> None:
    with pytest.raises(UnsupportedFormatError, match=r"modelopt|compressed-tensors") as info:
        check_layout(QuantRecipe.parse(recipe), FG)
    assert (
        FG not in str(info.value).split(";", 1)[-1]
    )  # the layouts named are the ones that hold it


def test_fp8_block_names_both_layouts_that_hold_it() -> None:
    """The ModelOpt layout holds blocks of 128 only (FP8_PB_WO: tests/test_fp8_pb_wo.py)."""
    with pytest.raises(UnsupportedFormatError, match=f"format={CT}.*format={FG}"):
        check_layout(QuantRecipe.parse("fp8_block:group_size=64"), "modelopt")


def test_a_model_in_another_format_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    model = quantize(tiny_hf_model("llama", seed=0).eval(), "int8_wo")
    with pytest.raises(UnsupportedFormatError, match=FG):
        exportlm.export_model("hf_checkpoint", model, tmp_path / "out", format=FG)
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_another_recipe_with_exit_2(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "exportlm", "export", "--target", "hf_checkpoint", "--model"]
    cmd += ["llama", "--out", str(tmp_path / "o"), "--quantize", "int4_awq", "-o", f"format={FG}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "format=compressed-tensors" in done.stderr
    assert "format=modelopt" in done.stderr
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- reading others'


def _deepseek_style(tmp_path: Path, block: int = 128) -> Path:
    """A checkpoint as DeepSeek-V3 ships one, written without exportlm: transformers' own
    quantizer's math (``scale = 448 / amax`` multiplied, ``weight_scale_inv = 1 / scale``),
    DeepSeek's config keys (``fmt``, no ``modules_to_not_convert``), no manifest."""
    from safetensors.torch import save_file

    model = tiny_hf_model("llama", seed=0).eval()
    out = tmp_path / "deepseek"
    out.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module = name.rpartition(".")[0]
        if isinstance(model.get_submodule(module), nn.Linear) and "lm_head" not in name:
            rows, cols = tensor.shape
            tiles = tensor.float().reshape(rows // block, block, cols // block, block)
            amax = tiles.abs().amax(dim=(1, 3))
            scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
            codes = (tiles * scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[name] = codes.reshape(rows, cols)
            tensors[f"{module}.weight_scale_inv"] = (1.0 / scale).float()
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [block, block],
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_deepseek_style_checkpoint_written_elsewhere_loads(tmp_path: Path) -> None:
    """32 output rows per tile edge: the toy's k_proj / v_proj (64 rows) fit tiles of 32 exactly."""
    out = _deepseek_style(tmp_path, block=32)
    got = _logits(load_unverified(out))
    want = _logits(_quantized("fp8_block:group_size=32"))
    # another quantizer's rounding (it multiplies by 448 / amax where we divide by amax / 448)
    # moved 1 code of the toy by one step: measured 1.7e-5, bound 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    assert inspect_checkpoint(out).summary["quantized_layers"] == {"fp8_block": 14}


_GARBAGE: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"weight_block_size": "absent"}, MalformedCheckpointError, "weight_block_size is absent"),
    ({"weight_block_size": [128]}, MalformedCheckpointError, "two positive ints"),
    ({"weight_block_size": ["128", 128]}, MalformedCheckpointError, "two positive ints"),
    ({"weight_block_size": [0, 0]}, MalformedCheckpointError, "two positive ints"),
    ({"activation_scheme": "absent"}, MalformedCheckpointError, "activation_scheme is None"),
    ({"activation_scheme": "static"}, MalformedCheckpointError, "vLLM takes only 'dynamic'"),
    ({"activation_scheme": 1}, MalformedCheckpointError, "activation_scheme is 1"),
    ({"scale_fmt": "e5m2"}, MalformedCheckpointError, "scale_fmt is 'e5m2'"),
    ({"modules_to_not_convert": "lm_head"}, MalformedCheckpointError, "list of module names"),
    ({"ignored_layers": ["model.layers.0.mlp.down_proj"]}, MalformedCheckpointError, "differ"),
    ({"scale_fmt": "ue8m0"}, UnsupportedFormatError, "scale_fmt 'ue8m0'"),
    ({"weight_block_size": None}, UnsupportedFormatError, "per-tensor"),
    ({"weight_block_size": [128, 64]}, UnsupportedFormatError, "not square"),
    ({"expert_dtype": "fp4"}, UnsupportedFormatError, "expert_dtype 'fp4'"),
    ({"modules_to_convert": ["model.embed_tokens"]}, UnsupportedFormatError, "modules_to_convert"),
    ({"weight_block_size": [64, 64]}, MalformedCheckpointError, r"weight_scale_inv has shape"),
]


@pytest.mark.parametrize(
    ("edit", "error", "match"), _GARBAGE, ids=[json.dumps(e[0]) for e in _GARBAGE]
)
def test_garbage_and_inconsistent_configs_are_refused(
    edit: dict[str, Any], error: type[Exception], match: str, tmp_path: Path
) -> None:
    out = _export(tmp_path)
    config = json.loads((out / "config.json").read_text())
    for key, value in edit.items():
        if value == "absent":
            del config["quantization_config"][key]
        else:
            config["quantization_config"][key] = value
    (out / "config.json").write_text(json.dumps(config))
    (out / MANIFEST).unlink()
    with pytest.raises(error, match=match) as info:
        load_unverified(out)
    assert type(info.value) is error  # not a subclass: the specific refusal
    if error is MalformedCheckpointError and "weight_scale_inv" not in match:
        rules = {f.rule for f in inspect_checkpoint(out).errors}
        assert "config-field-invalid" in rules  # inspect reports what the loader refuses


def test_a_scale_of_the_wrong_shape_is_refused_naming_it(tmp_path: Path) -> None:
    out = _export(tmp_path, "fp8_block:group_size=32")
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    edit_checkpoint_tensors(out, {name: lambda t: t.reshape(-1, t.shape[0])})  # [8, 4] -> [4, 8]
    with pytest.raises(MalformedCheckpointError, match=rf"{name} has shape \[4, 8\].*\[8, 4\]"):
        load_unverified(out)


# ----------------------------------------------------------------------------- the loaders


def test_transformers_loads_it_on_cpu_by_dequantizing(tmp_path: Path) -> None:
    """transformers' FineGrainedFP8 needs a GPU for its FP8 kernels; without one it dequantizes
    (quantizer_finegrained_fp8.py ``validate_environment``: ``dequantize = True``), so its
    linears are float and the inputs stay unquantized: the weight-only fake-quant logits."""
    transformers = pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("a GPU: transformers would run its FP8 kernels, not the dequantize path")
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    out = _export(tmp_path)
    config = AUTO_QUANTIZATION_CONFIG_MAPPING["fp8"].from_dict(_config(out))
    assert type(config) is transformers.FineGrainedFP8Config
    assert (config.weight_block_size, config.activation_scheme) == ([128, 128], "dynamic")
    assert config.modules_to_not_convert == ["lm_head", "model.embed_tokens"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
    q_proj = model.model.layers[0].self_attn.q_proj  # dequantized: a float linear
    assert (type(q_proj), q_proj.weight.dtype) == (nn.Linear, torch.float32)
    got = _logits(model)
    # the same dequantized weights, float32: measured 3e-7
    torch.testing.assert_close(got, _weight_only_logits(_quantized()), rtol=0, atol=LOGITS_ATOL)


def test_transformers_loads_moe_experts_on_cpu_by_dequantizing(tmp_path: Path) -> None:
    """Qwen3-MoE: transformers merges the per-expert linears into its fused experts after
    dequantizing each (``Fp8Dequantize`` runs first in the conversion chain)."""
    transformers = pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("a GPU: transformers would run its FP8 kernels, not the dequantize path")
    model = _quantized("fp8_block:group_size=32", "qwen3_moe")
    ids = IDS.remainder(int(model.config.vocab_size))
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "moe", format=FG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    # measured 3.6e-7 (float32)
    want = _weight_only_logits(model, ids)
    torch.testing.assert_close(_logits(loaded, ids), want, rtol=0, atol=LOGITS_ATOL)


def test_a_partial_last_row_tile_is_misread_by_transformers_and_inspect_says_so(
    tmp_path: Path,
) -> None:
    """k_proj / v_proj of 3 heads of 64 (192 rows) in tiles of 128: two scale rows, the second
    half full. transformers' dequantizing load reads them as tiles of 96 (rows // scale rows);
    vLLM (``ceil``) and our loader read them right."""
    transformers = pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("a GPU: transformers would run its FP8 kernels, not the dequantize path")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=384,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=64,
    )
    model = quantize(transformers.LlamaForCausalLM(config).eval(), "fp8_block")
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "partial", format=FG)
    found = [f for f in inspect_checkpoint(out).findings if f.rule == "loader-misreads"]
    assert len(found) == 1
    assert "k_proj.weight" in found[0].message
    ours = _logits(exportlm.load_exported("hf_checkpoint", out))
    torch.testing.assert_close(ours, _logits(model), rtol=0, atol=LOGITS_ATOL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _logits(transformers.AutoModelForCausalLM.from_pretrained(out))
    # measured 0.080 off the weight-only logits (3e-7 where the tiles are whole)
    assert (theirs - _weight_only_logits(model)).abs().max() > 1e-2


_VLLM_PARSE = """
import json, sys
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
config = Fp8Config.from_config(json.load(open(sys.argv[1]))["quantization_config"])
print(json.dumps({"name": config.get_name(), "block": config.weight_block_size,
                  "scheme": config.activation_scheme, "ignored": config.ignored_layers}))
"""


def test_vllm_fp8_config_parses_it_and_reports_the_block(tmp_path: Path) -> None:
    """Parsing only: vLLM's CPU FP8 block GEMMs need AMX (docs/engines.md), this CPU has none."""
    out = _export(tmp_path, "fp8_block:group_size=64")
    done = subprocess.run(
        [_vllm_python(), "-c", _VLLM_PARSE, str(out / "config.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == {
        "name": "fp8",
        "block": [64, 64],
        "scheme": "dynamic",
        "ignored": ["lm_head", "model.embed_tokens"],
    }


def test_the_engine_tables_name_it(tmp_path: Path) -> None:
    from exportlm.engines import Verdict, artifact_kind, get_engine

    kind = artifact_kind(_export(tmp_path, "fp8_block:group_size=32"))
    assert (kind.layout, kind.scheme) == ("fp8", "FP8_BLOCK")
    vllm = get_engine("vllm")
    on_cpu = vllm.support(kind.target, kind.layout, kind.scheme, dtype="bfloat16")
    assert on_cpu.verdict is Verdict.ENGINE_LIMIT
    assert "AMX" in on_cpu.reason
    on_gpu = vllm.support(kind.target, kind.layout, kind.scheme, device="cuda", dtype="bfloat16")
    assert on_gpu.verdict is Verdict.RUNS


# ----------------------------------------------------------------------------- the CLI


def test_the_cli_exports_it(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "exportlm", "export", "--target", "hf_checkpoint"]
    cmd += ["--model", "llama", "--out", str(out), "--quantize", "fp8_block:group_size=64"]
    cmd += ["-o", f"format={FG}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert _config(out)["weight_block_size"] == [64, 64]
    assert inspect_checkpoint(out).errors == []


@pytest.mark.real_model
def test_the_real_model_exports_from_its_directory(real_model_dir: Path, tmp_path: Path) -> None:
    """SmolLM2-135M: hidden size 576 is no multiple of 128, so tiles of 64 (9 x 64)."""
    from exportlm.cli import main

    out = tmp_path / "real"
    argv = ["export", "--target", "hf_checkpoint", "--model", str(real_model_dir)]
    argv += ["--out", str(out), "--quantize", "fp8_block:group_size=64", "-o", f"format={FG}"]
    assert main(argv) == 0
    assert _config(out)["weight_block_size"] == [64, 64]
    report = inspect_checkpoint(out)
    assert report.errors == [], [f.message for f in report.errors]
    assert report.summary["quantized_layers"] == {"fp8_block": 30 * 7}
