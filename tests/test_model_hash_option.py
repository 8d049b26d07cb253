"""The manifest's model hash is asked for (``EXPORTLM_MODEL_HASH=1``), off by default.

Nothing reads ``model_blake3``: the trust model is every file's digest, checked on every
load, with or without it (see ``docs/security.md``, "The model hash is asked for").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import exportlm
from exportlm.errors import ArtifactIntegrityError
from exportlm.export.manifest import model_hash, read_manifest
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize


def _fp8() -> Any:
    model = tiny_hf_model("llama", num_hidden_layers=1)
    batch = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator())
    quantize(model, "fp8", calibrate=lambda m: m(batch))
    return model


@pytest.mark.parametrize("target", ["hf_checkpoint", "torchscript"])
def test_a_manifest_has_no_model_hash_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    monkeypatch.delenv("EXPORTLM_MODEL_HASH", raising=False)
    model = _fp8() if target == "hf_checkpoint" else tiny_hf_model("llama", num_hidden_layers=1)
    out = exportlm.export_model(target, model, tmp_path / "a")
    manifest = read_manifest(out)
    assert manifest is not None
    assert manifest.model_hash is None
    assert manifest.data["model_blake3"] is None  # the key stays: schema 3 unchanged
    assert manifest.files  # every file is still listed with its digest...
    assert exportlm.load_exported(target, out, trust=True) is not None  # ...and verified


@pytest.mark.parametrize("value", ["1", "true"])
def test_exportlm_model_hash_records_the_models_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("EXPORTLM_MODEL_HASH", value)
    model = _fp8()
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "a")
    data = json.loads((out / "exportlm-manifest.json").read_text())
    assert data["model_blake3"] == model_hash(model)


def test_a_tampered_shard_is_refused_without_a_model_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EXPORTLM_MODEL_HASH", raising=False)
    out = exportlm.export_model("hf_checkpoint", _fp8(), tmp_path / "a")
    shard = out / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError, match=r"model\.safetensors"):
        exportlm.load_exported("hf_checkpoint", out)
