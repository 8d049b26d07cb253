"""``inspect``'s loader verdicts hold against the loaders themselves (transformers, this venv).

* ModelOpt layout, codes one per element (FP8, FP8 dynamic, INT8 SmoothQuant, FP8 + FP8
  KV): transformers has no ``modelopt`` quantizer (``transformers/quantizers/auto.py``,
  ``AUTO_QUANTIZATION_CONFIG_MAPPING``, up to 5.25), logs "Unknown quantization type" and
  loads the model unquantized: the codes become the weights, every scale an unexpected
  key. It raises nothing and computes something else, so ``inspect`` warns
  ``loader-misreads``. Here: its logits are further from the fake-quant model's than
  the logits' own largest magnitude, ours within 0.02 (bf16).
* ModelOpt layout, packed codes (INT4 AWQ, NVFP4): the packed weights do not fit the
  float model, transformers refuses them (size mismatch): no misread, ``inspect`` says
  "not in transformers".
* compressed-tensors FP8 + FP8 KV: transformers 5.25 (this venv) loads it and drops
  ``k_scale`` / ``v_scale`` as unexpected keys (compressed-tensors finds attention modules
  by a ``past_key_values`` parameter, which 5.25 renamed ``cache``): ``inspect`` says so;
  with a transformers whose attention takes ``past_key_values`` (5.19) it does not.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import exportlm
from exportlm.inspection import inspect_checkpoint
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize

MISREAD = ("fp8", "fp8_dynamic", "int8_sq", "fp8+fp8_kv")
REFUSED = ("int4_awq", "nvfp4")
#: bf16 logits of the toy Llama: ours vs its fake-quant model (measured: at most 0.015).
OURS_ATOL = 0.05


def _export(recipe: str, out: Path, **options: Any) -> tuple[torch.nn.Module, Path]:
    model = tiny_hf_model("llama", seed=0).eval().to(torch.bfloat16)
    batch = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    quantize(model, recipe, calibrate=lambda m: m(batch))
    return model, Path(exportlm.export_model("hf_checkpoint", model, out, **options))


def _ids(model: torch.nn.Module) -> torch.Tensor:
    vocab = model.config.vocab_size  # type: ignore[union-attr]
    return torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(1))


def _transformers(path: Path) -> tuple[Any, dict[str, list[str]]]:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", output_loading_info=True
        )
    return model.eval(), info


def _findings(path: Path, rule: str) -> list[Any]:
    return [f for f in inspect_checkpoint(path).findings if f.rule == rule]


@pytest.mark.parametrize("recipe", MISREAD)
def test_modelopt_layout_that_transformers_misreads_is_a_warning(
    recipe: str, tmp_path: Path
) -> None:
    model, path = _export(recipe, tmp_path / "ckpt")
    ids = _ids(model)
    with torch.no_grad():
        expected = model(ids).logits.float()
    hf, info = _transformers(path)
    assert any(k.endswith("weight_scale") for k in info["unexpected_keys"])  # scales dropped
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    assert (theirs - expected).abs().max() > expected.abs().max()  # garbage, no error
    ours = torch.as_tensor(exportlm.load_exported("hf_checkpoint", path)(ids)).float()
    torch.testing.assert_close(ours, expected, atol=OURS_ATOL, rtol=0)

    (warning,) = _findings(path, "loader-misreads")
    assert warning.severity.value == "warning"
    assert "misread by transformers" in warning.message
    (loaders,) = _findings(path, "quant-method-loaders")
    assert not any(name.startswith("transformers") for name in loaders.details["unknown"])


@pytest.mark.parametrize("recipe", REFUSED)
def test_modelopt_layout_that_transformers_refuses_is_no_misread(
    recipe: str, tmp_path: Path
) -> None:
    _, path = _export(recipe, tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="mismatch"):
        _transformers(path)
    assert _findings(path, "loader-misreads") == []
    (loaders,) = _findings(path, "quant-method-loaders")
    assert any(name.startswith("transformers") for name in loaders.details["unknown"])


def test_compressed_tensors_kv_scales_transformers_drops_are_stated(tmp_path: Path) -> None:
    _, path = _export("fp8+fp8_kv", tmp_path / "ckpt", format="compressed-tensors")
    _, info = _transformers(path)
    dropped = [k for k in info["unexpected_keys"] if k.endswith(("k_scale", "v_scale"))]
    assert dropped  # transformers' own load report
    (loaders,) = _findings(path, "quant-method-loaders")
    assert loaders.details["kv_scales_dropped"] is True
    assert "drops the KV-cache scales" in loaders.message
    assert _findings(path, "loader-misreads") == []


def test_compressed_tensors_without_kv_cache_says_nothing_of_kv_scales(tmp_path: Path) -> None:
    _, path = _export("fp8", tmp_path / "ckpt", format="compressed-tensors")
    findings = _findings(path, "quant-method-loaders")
    assert all("KV-cache" not in f.message for f in findings)


def test_no_kv_note_where_transformers_attention_takes_past_key_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exportlm.inspection import _loaders

    _, path = _export("fp8+fp8_kv", tmp_path / "ckpt", format="compressed-tensors")
    monkeypatch.setattr(_loaders, "_attention_takes_past_key_values", lambda: True)
    (loaders,) = _findings(path, "quant-method-loaders")
    assert loaders.details["kv_scales_dropped"] is False
