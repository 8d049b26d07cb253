"""Interop with the reference implementations (optional packages; ``-m interop``).

(a) NVIDIA ModelOpt on CPU: the same tiny Llama (and Mixtral), the same calibration
    batch, FP8 — our checkpoint's tensors equal ModelOpt's ``export_hf_checkpoint``
    (names, dtypes, shapes, bytes) and ``hf_quant_config.json`` is equal except the
    producer (Mixtral: the router is excluded under its saved name
    ``block_sparse_moe.gate``, as ModelOpt lists it).
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


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_fp8_checkpoint_equals_modelopt(family: str, tmp_path: Path) -> None:
    mtq = pytest.importorskip("modelopt.torch.quantization")
    modelopt_export = pytest.importorskip("modelopt.torch.export")
    from exportlm.quant import quantize

    model = tiny_hf_model(family, seed=0).eval()
    model.config.architectures = [type(model).__name__]  # ModelOpt reads it
    batch = _calibration_batch(model.config.vocab_size)
    theirs = copy.deepcopy(model)

    def calibrate(m: Any) -> None:
        with torch.no_grad():
            m(batch)

    quantize(model, "fp8", calibrate=calibrate)
    ours_dir = exportlm.export_model("hf_checkpoint", model, tmp_path / "ours")
    mtq.quantize(theirs, mtq.FP8_DEFAULT_CFG, forward_loop=calibrate)
    modelopt_export.export_hf_checkpoint(theirs, export_dir=tmp_path / "modelopt")

    ours, ref = _tensors(ours_dir), _tensors(tmp_path / "modelopt")
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        assert (ours[name].dtype, ours[name].shape) == (tensor.dtype, tensor.shape), name
        if name.endswith(("input_scale", "k_scale", "v_scale")):
            # Activation scales come from two calibration forwards through different
            # wrappers (ModelOpt's and ours): equal here, but their last bit is not a
            # pure function of the inputs, so they are compared within 1e-6 (relative).
            torch.testing.assert_close(ours[name], tensor, rtol=1e-6, atol=0.0, msg=name)
            continue
        # Weights and weight scales are pure functions of the same weights: bytes.
        assert torch.equal(
            ours[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        ), name

    ours_cfg = json.loads((ours_dir / "hf_quant_config.json").read_text())
    ref_cfg = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())
    assert ours_cfg["producer"]["name"] == "exportlm"
    ours_q, ref_q = ours_cfg["quantization"], ref_cfg["quantization"]
    excluded = sorted(ref_q.pop("exclude_modules"))
    assert sorted(ours_q.pop("exclude_modules")) == excluded
    assert ours_q == ref_q
    if family == "mixtral":
        assert "model.layers.0.block_sparse_moe.gate" in excluded
    ours_qc = json.loads((ours_dir / "config.json").read_text())["quantization_config"]
    ref_qc = json.loads((tmp_path / "modelopt" / "config.json").read_text())["quantization_config"]
    assert sorted(ours_qc["ignore"]) == sorted(ref_qc["ignore"]) == excluded


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
