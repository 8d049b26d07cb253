"""``inspect`` judged against the loaders: a BF16 ``pre_quant_scale`` in the ModelOpt layout.

ModelOpt 0.47's own ``int8_sq`` export of a bfloat16 model stores each linear's
``pre_quant_scale`` (the SmoothQuant multiplier of its input activations) as BF16; the
loaders read it, but ``inspect``'s ``scale-dtype`` rule failed every such tensor. Here our
own ``int8_sq`` checkpoint's multipliers are rewritten to BF16, as ModelOpt stores them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import exportlm
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize


def _rewritten(out: Path, dtype: torch.dtype) -> int:
    """Every ``pre_quant_scale`` stored as ``dtype``, the manifest dropped (a foreign producer's
    checkpoint has none); returns how many were rewritten."""
    count = 0
    for shard in out.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for name, tensor in tensors.items():
            if name.endswith(".pre_quant_scale"):
                tensors[name] = tensor.to(dtype)
                count += 1
        save_file(tensors, str(shard), metadata={"format": "pt"})
    for manifest in out.glob("*manifest*.json"):
        manifest.unlink()
    return count


@pytest.fixture(scope="module")
def int8_sq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_hf_model("llama", seed=0).eval()
    batch = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator())
    quantize(model, "int8_sq", calibrate=lambda m: m(batch))
    return exportlm.export_model("hf_checkpoint", model, tmp_path_factory.mktemp("sq") / "ckpt")


def _errors(path: Path) -> list[str]:
    return [f"[{f.rule}] {f.subject}" for f in inspect_checkpoint(path).errors]


def test_a_bf16_pre_quant_scale_passes_inspect_and_loads(int8_sq: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "bf16"
    foreign.mkdir()
    for file in int8_sq.iterdir():
        (foreign / file.name).write_bytes(file.read_bytes())
    assert _rewritten(foreign, torch.bfloat16) > 0
    assert _errors(foreign) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no manifest: loaded unverified
        logits = exportlm.load_exported("hf_checkpoint", foreign)(torch.tensor([[1, 5, 9, 3]]))
    assert torch.isfinite(torch.as_tensor(logits)).all()


def test_a_pre_quant_scale_that_is_no_float_is_still_refused(int8_sq: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "int"
    foreign.mkdir()
    for file in int8_sq.iterdir():
        (foreign / file.name).write_bytes(file.read_bytes())
    assert _rewritten(foreign, torch.int32) > 0
    assert any(e.startswith("[scale-dtype]") and "pre_quant_scale" in e for e in _errors(foreign))
