"""INT8 SmoothQuant (``int8_sq``) against NVIDIA ModelOpt 0.47 on CPU (``-m interop``).

The same tiny model and calibration batch through ModelOpt's ``INT8_SMOOTHQUANT_CFG``
+ ``export_hf_checkpoint`` and through ``quantize(model, "int8_sq")`` +
``export_model("hf_checkpoint", ...)``: every tensor has the same name, dtype, shape
and bytes (the smoothing scales, the smoothed int8 weights, their per-row scales);
``input_scale`` within 1e-6 (two calibration forwards through different wrappers);
``hf_quant_config.json`` and ``config.json``'s ``quantization_config`` equal key for
key but the producer. Dense Llama (GQA, MHA, tied) and two MoE families (Mixtral,
Qwen3-MoE: ModelOpt smooths the attention linears; the fused experts are quantized,
not smoothed, as ModelOpt does).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import exportlm
from exportlm.models import tiny_hf_model
from tests.test_interop import _assert_same_tensor

pytestmark = pytest.mark.interop

FAMILIES = ["llama", "llama_tied", "llama_mha", "mixtral", "qwen3_moe"]


def _export_both(family: str, tmp_path: Path) -> tuple[Path, Path]:
    mtq = pytest.importorskip("modelopt.torch.quantization")
    modelopt_export = pytest.importorskip("modelopt.torch.export")
    from exportlm.quant import quantize

    overrides = {"num_key_value_heads": 4} if family == "llama_mha" else {}
    model = tiny_hf_model(family.removesuffix("_mha"), seed=0, **overrides).eval()
    model.config.architectures = [type(model).__name__]  # ModelOpt reads it
    batch = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    reference = copy.deepcopy(model)

    def calibrate(m: Any) -> None:
        with torch.no_grad():
            m(batch)

    quantize(model, "int8_sq", calibrate=calibrate)
    ours = exportlm.export_model("hf_checkpoint", model, tmp_path / "ours")
    mtq.quantize(reference, mtq.INT8_SMOOTHQUANT_CFG, forward_loop=calibrate)
    modelopt_export.export_hf_checkpoint(reference, export_dir=tmp_path / "modelopt")
    return ours, tmp_path / "modelopt"


def _state(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(shard))
    return state


def _configs(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(hf_quant_config.json, config.json's quantization_config)``, producer removed,
    module lists sorted."""
    quant = json.loads((directory / "hf_quant_config.json").read_text())
    quant.pop("producer")
    quant["quantization"]["exclude_modules"].sort()
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    config.pop("producer")
    config["ignore"].sort()
    return quant, config


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_sq_checkpoint_equals_modelopt(family: str, tmp_path: Path) -> None:
    ours_dir, ref_dir = _export_both(family, tmp_path)
    ours, ref = _state(ours_dir), _state(ref_dir)
    assert sorted(ours) == sorted(ref)
    assert any(name.endswith("pre_quant_scale") for name in ref)  # smoothing happened
    for name, tensor in ref.items():
        _assert_same_tensor(name, ours[name], tensor)
    assert _configs(ours_dir) == _configs(ref_dir)
    assert _configs(ours_dir)[0]["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
