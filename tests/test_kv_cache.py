"""KV-cache quantization: scales of the tensors the cache holds, and what a serving engine does with them.

K is quantized after RoPE (and after Qwen3's ``k_norm``), inside the attention
function, and its scale is ``amax / 448`` unclamped (as ModelOpt writes it). The
``hf_checkpoint`` runtime applies ``k_scale`` / ``v_scale`` to the cached K / V the way
vLLM's FP8 cache does; :func:`kv_cache_roundtrip` compares it with the fake-quant model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import exportlm
from exportlm.export.hf_checkpoint import kv_cache_roundtrip
from exportlm.export.manifest import manifest_path
from exportlm.models import DecoderModel, tiny_hf_model
from exportlm.quant import FP8_MAX, QuantRecipe, quantize

LAYER0 = "model.layers.0.self_attn"


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def _cached_kv_amax(model: Any, batch: torch.Tensor) -> tuple[float, float, float]:
    """amax of layer 0's cached K and V (what the model's own cache holds) and of k_proj's output."""
    seen: dict[str, float] = {}
    attn = model.get_submodule(LAYER0)
    handle = attn.k_proj.register_forward_hook(
        lambda _m, _a, out: seen.__setitem__("k_proj", float(out.abs().max()))
    )
    with torch.no_grad():
        out = model(batch, use_cache=True)
    handle.remove()
    layer = out.past_key_values.layers[0]
    return float(layer.keys.abs().max()), float(layer.values.abs().max()), seen["k_proj"]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral", "gpt_oss"])
def test_kv_scales_are_the_amax_of_the_cached_tensors_over_448(family: str) -> None:
    model = tiny_hf_model(family, seed=0)
    batch = _batch(model.config.vocab_size)
    k_amax, v_amax, k_proj_amax = _cached_kv_amax(model, batch)
    quantize(model, "fp8+fp8_kv", calibrate=lambda m: m(batch))
    attn = model.get_submodule(LAYER0)
    k_scale = float(attn.k_proj.output_quantizer.scale)
    v_scale = float(attn.v_proj.output_quantizer.scale)
    # the calibration forward runs the same eager kernels on the same (unquantized) inputs
    assert k_scale == pytest.approx(k_amax / FP8_MAX, rel=1e-5)
    assert v_scale == pytest.approx(v_amax / FP8_MAX, rel=1e-5)
    assert k_scale < 0.05  # never clamped to 1.0
    if family == "qwen3_moe":  # k_norm rescales K: the projection output is the wrong tensor
        assert k_amax > 2 * k_proj_amax


def test_a_model_without_an_attention_interface_quantizes_its_projection_outputs() -> None:
    model = DecoderModel(num_layers=1)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    quantize(model, "fp8_kv", calibrate=lambda m: m(ids))
    k_proj = model.layers[0].self_attn.k_proj
    with torch.no_grad():
        amax = float(k_proj(model.pos_encoding(model.embed_tokens(ids))).abs().max())
    assert k_proj.output_quantizer.kv_site == "projection"
    assert float(k_proj.output_quantizer.scale) < 0.05 < amax * 100


def test_a_recipe_floor_clamps_the_kv_scales() -> None:
    model = tiny_hf_model("llama", seed=0)
    batch = _batch(model.config.vocab_size)
    recipe = QuantRecipe(algo="fp8", kv_cache="fp8_kv", kv_cache_min_scale=1.0)
    quantize(model, recipe, calibrate=lambda m: m(batch))
    assert float(model.get_submodule(LAYER0).k_proj.output_quantizer.scale) == 1.0
    with pytest.raises(ValueError, match="kv_cache_min_scale"):
        QuantRecipe(kv_cache="fp8_kv", kv_cache_min_scale=0.0)


def test_the_fake_quant_forward_applies_the_fp8_cache() -> None:
    model = tiny_hf_model("llama", seed=0)
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        plain = model(batch).logits
    quantize(model, "fp8_kv", calibrate=lambda m: m(batch))  # only the KV cache
    with torch.no_grad():
        quantized = model(batch).logits
    diff = float((quantized - plain).abs().max())
    assert 0.0 < diff < 0.05  # the cache is FP8: logits move, a little


def _small_kv_model() -> Any:
    """A Llama whose K and V are ~1e-3 (k/v_proj scaled down, q/o_proj up: same function)."""
    model = tiny_hf_model("llama", seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.k_proj.weight.mul_(1e-3)
            attn.q_proj.weight.mul_(1e3)
            attn.v_proj.weight.mul_(1e-3)
            attn.o_proj.weight.mul_(1e3)
    return model


def _with_unit_kv_scales(directory: Path) -> None:
    """Rewrite k_scale / v_scale as 1.0: a checkpoint as another tool (no manifest) writes it."""
    manifest_path(directory).unlink(missing_ok=True)
    for file in directory.glob("*.safetensors"):
        tensors = load_file(str(file))
        for name in tensors:
            if name.endswith(("k_scale", "v_scale")):
                tensors[name] = torch.ones_like(tensors[name])
        save_file(tensors, str(file), metadata={"format": "pt"})


def test_the_kv_roundtrip_passes_with_amax_scales_and_fails_with_unit_scales(
    tmp_path: Path,
) -> None:
    model = _small_kv_model()
    batch = _batch(model.config.vocab_size)
    quantize(model, "fp8_kv", calibrate=lambda m: m(batch))
    k_scale = float(model.get_submodule(LAYER0).k_proj.output_quantizer.scale)
    assert k_scale < 1e-4  # |K| ~ 1e-3, far from 448
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt")

    good = kv_cache_roundtrip(model, out, batch)
    # same eager kernels, same FP8 cache values: the logits agree to float rounding
    assert good.passed(rtol=1e-4), good
    _with_unit_kv_scales(out)
    bad = kv_cache_roundtrip(model, out, batch)
    print(
        f"KV roundtrip relative error: amax/448 scales {good.relative:.3g}, 1.0 {bad.relative:.3g}"
    )
    assert not bad.passed(rtol=1e-2), bad
    assert bad.relative > 100 * max(good.relative, 1e-7)


@pytest.mark.parametrize(
    "family",
    ["llama", "llama_tied", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "llama4"],
)
def test_the_kv_roundtrip_passes_for_every_family(family: str, tmp_path: Path) -> None:
    """Every HF toy family: the checkpoint's KV scales, applied as vLLM does, give the fake-quant
    model's logits (same eager kernels, same FP8 cache values: float rounding apart)."""
    from exportlm.models import build_model

    model = build_model(family, seed=0)
    batch = _batch(model.config.vocab_size)
    quantize(model, "fp8_kv", calibrate=lambda m: m(batch))
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt")
    names = [n for f in out.glob("*.safetensors") for n in load_file(str(f))]
    assert any(n.endswith(".k_scale") for n in names), f"{family}: no k_scale written"
    result = kv_cache_roundtrip(model, out, batch)
    assert result.passed(rtol=1e-4), f"{family}: {result}"


def test_a_kv_recipe_on_fused_qkv_is_refused_before_anything_changes() -> None:
    """DBRX's fused ``Wqkv`` has no K / V projection to measure: refused, not silently dropped."""
    from exportlm.errors import UnsupportedFormatError
    from exportlm.models import build_model

    model = build_model("dbrx", seed=0)
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(UnsupportedFormatError, match=r"KV-cache quantization.*Wqkv"):
        quantize(model, "fp8+fp8_kv")
    assert {n: type(m) for n, m in model.named_modules()} == before
