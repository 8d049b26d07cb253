"""Interop with the reference implementations (optional packages; ``-m interop``).

(a) NVIDIA ModelOpt 0.47 on CPU: the same tiny models (Llama untied / tied / MHA,
    Mixtral, Qwen3-MoE) and calibration batch. FP8, FP8 + FP8 KV cache, NVFP4 and INT8
    weight-only: our checkpoint's tensors equal ModelOpt's ``export_hf_checkpoint``
    (names, dtypes, shapes, bytes; activation and KV scales within 1e-6) and
    ``hf_quant_config.json`` / ``config.json``'s ``quantization_config`` are equal key
    for key except the producer. INT4 AWQ: configs, dtypes and shapes (values differ).
(b) compressed-tensors: our ``format="compressed-tensors"`` checkpoint loads in
    transformers, with weights equal to our dequantization.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import exportlm
from exportlm.models import tiny_hf_model

pytestmark = pytest.mark.interop


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                out[key] = f.get_tensor(key)
    return out


def _calibration_batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def _modelopt_config(mtq: Any, recipe: str) -> dict[str, Any]:
    if recipe == "fp8+fp8_kv":  # ModelOpt's FP8 config merged with its FP8 KV-cache config
        fp8 = mtq.FP8_DEFAULT_CFG
        return {**fp8, "quant_cfg": [*fp8["quant_cfg"], *mtq.FP8_KV_CFG["quant_cfg"]]}
    names = {
        "fp8": "FP8_DEFAULT_CFG",
        "nvfp4": "NVFP4_DEFAULT_CFG",
        "int8_wo": "INT8_WEIGHT_ONLY_CFG",
        "int4_awq": "INT4_AWQ_CFG",
    }
    config: dict[str, Any] = getattr(mtq, names[recipe])
    return config


def _both(family: str, recipe: str, tmp_path: Path) -> tuple[Path, Path]:
    """Our checkpoint and ModelOpt's, of the same tiny model and calibration batch."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    modelopt_export = pytest.importorskip("modelopt.torch.export")
    from exportlm.quant import quantize

    overrides = {"num_key_value_heads": 4} if family == "llama_mha" else {}
    model = tiny_hf_model(family.removesuffix("_mha"), seed=0, **overrides).eval()
    model.config.architectures = [type(model).__name__]  # ModelOpt reads it
    batch = _calibration_batch(model.config.vocab_size)
    theirs = copy.deepcopy(model)

    def calibrate(m: Any) -> None:
        with torch.no_grad():
            m(batch)

    quantize(model, recipe, calibrate=calibrate)
    ours_dir = exportlm.export_model("hf_checkpoint", model, tmp_path / "ours")
    mtq.quantize(theirs, _modelopt_config(mtq, recipe), forward_loop=calibrate)
    modelopt_export.export_hf_checkpoint(theirs, export_dir=tmp_path / "modelopt")
    return ours_dir, tmp_path / "modelopt"


def _assert_configs_equal(ours_dir: Path, ref_dir: Path, family: str) -> None:
    """``hf_quant_config.json`` and ``config.json``'s ``quantization_config``, key for key.

    One known difference: with tied embeddings ModelOpt also lists ``lm_head``, a module
    whose weight the checkpoint does not save; ours lists saved modules only.
    """
    ours_cfg = json.loads((ours_dir / "hf_quant_config.json").read_text())
    ref_cfg = json.loads((ref_dir / "hf_quant_config.json").read_text())
    assert ours_cfg.pop("producer")["name"] == "exportlm"
    ref_cfg.pop("producer")
    ref_qc = json.loads((ref_dir / "config.json").read_text())["quantization_config"]
    if family.endswith("_tied"):
        ref_cfg["quantization"]["exclude_modules"].remove("lm_head")
        ref_qc["ignore"].remove("lm_head")
    for cfg in (ours_cfg, ref_cfg):
        cfg["quantization"]["exclude_modules"].sort()
    assert ours_cfg == ref_cfg
    ours_qc = json.loads((ours_dir / "config.json").read_text())["quantization_config"]
    for qc in (ours_qc, ref_qc):
        qc.pop("producer")
        qc["ignore"].sort()
    assert ours_qc == ref_qc


# Tied / untied / MHA Llama, Mixtral (fused experts), Qwen3-MoE (k_norm before RoPE).
FAMILIES = ["llama", "llama_tied", "llama_mha", "mixtral", "qwen3_moe"]
EXACT_RECIPES = ["fp8", "fp8+fp8_kv", "nvfp4", "int8_wo"]


@pytest.mark.parametrize("recipe", EXACT_RECIPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_equals_modelopt(family: str, recipe: str, tmp_path: Path) -> None:
    ours_dir, ref_dir = _both(family, recipe, tmp_path)
    ours, ref = _tensors(ours_dir), _tensors(ref_dir)
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        assert (ours[name].dtype, ours[name].shape) == (tensor.dtype, tensor.shape), name
        if name.endswith(("input_scale", "k_scale", "v_scale")):
            # Activation scales come from two calibration forwards through different
            # wrappers (ModelOpt's and ours): their last bit is not a pure function of
            # the inputs (Qwen3-MoE expert inputs differ by one float32 ulp), so they
            # are compared within 1e-6 (relative).
            torch.testing.assert_close(ours[name], tensor, rtol=1e-6, atol=0.0, msg=name)
            continue
        # Weights and weight scales are pure functions of the same weights: bytes.
        assert torch.equal(
            ours[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        ), name
    _assert_configs_equal(ours_dir, ref_dir, family)


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_int4_awq_checkpoint_matches_modelopt_in_layout(family: str, tmp_path: Path) -> None:
    """Configs, and the dtypes / shapes of the tensors both write (values differ: ModelOpt
    searches the AWQ scales, and folds those of norm-fed linears into the norm)."""
    ours_dir, ref_dir = _both(family, "int4_awq", tmp_path)
    ours, ref = _tensors(ours_dir), _tensors(ref_dir)
    for name in sorted(set(ours) & set(ref)):
        assert (ours[name].dtype, ours[name].shape) == (ref[name].dtype, ref[name].shape), name
    assert set(ref) <= set(ours)
    _assert_configs_equal(ours_dir, ref_dir, family)


def test_compressed_tensors_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors")
    import transformers

    from exportlm.export.hf_checkpoint import load_hf_checkpoint
    from exportlm.quant import quantize

    model = tiny_hf_model("llama", seed=0).eval()
    batch = _calibration_batch(model.config.vocab_size)
    quantize(model, "fp8", calibrate=lambda m: m(batch))
    out = exportlm.export_model(
        "hf_checkpoint", model, tmp_path / "ct", format="compressed-tensors"
    )

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    stored = _tensors(out)
    run = load_hf_checkpoint(out)  # our dequantizing runtime on the same directory
    name = "model.layers.0.self_attn.q_proj"
    ours = stored[f"{name}.weight"].float() * stored[f"{name}.weight_scale"].float()
    module = loaded.get_submodule(name)
    # compressed-tensors keeps the FP8 codes and the scale; dequantize them its way
    theirs = module.weight.float() * module.weight_scale.float()
    assert torch.equal(theirs, ours)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(batch, use_cache=False).logits, run(batch), atol=1e-3, rtol=1e-3
        )
