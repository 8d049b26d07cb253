"""Interop with the reference implementations (optional packages; ``-m interop``).

(a) NVIDIA ModelOpt 0.47 on CPU: the same tiny models (Llama untied / tied / MHA,
    Mixtral, Qwen3-MoE) and calibration batch. FP8, FP8 + FP8 KV cache, NVFP4 and INT8
    weight-only: our checkpoint's tensors equal ModelOpt's ``export_hf_checkpoint``
    (names, dtypes, shapes, bytes; activation and KV scales within 1e-6) and
    ``hf_quant_config.json`` / ``config.json``'s ``quantization_config`` are equal key
    for key except the producer. INT4 AWQ: names, configs, dtypes and shapes (values differ where the searches do).
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


def _assert_same_tensor(
    name: str, got: torch.Tensor, want: torch.Tensor, close: tuple[str, ...] = ("input_scale",)
) -> None:
    """Same dtype and shape; bytes equal, or within 1e-6 (relative) for names ending in ``close``.

    Weights and weight scales are pure functions of the same weights: bytes. Activation
    scales come from two calibration forwards through different wrappers (ModelOpt's and
    ours): their last bit is not a pure function of the inputs (Qwen3-MoE expert inputs
    differ by one float32 ulp), so they are compared within 1e-6.
    """
    assert (got.dtype, got.shape) == (want.dtype, want.shape), name
    if name.endswith(close):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0, msg=name)
    else:
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (
            name
        )


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
    """``hf_quant_config.json`` and ``config.json``'s ``quantization_config``, key for key
    (with tied embeddings both list ``lm_head``, whose weight is the saved embedding)."""
    ours_cfg = json.loads((ours_dir / "hf_quant_config.json").read_text())
    ref_cfg = json.loads((ref_dir / "hf_quant_config.json").read_text())
    assert ours_cfg.pop("producer")["name"] == "exportlm"
    ref_cfg.pop("producer")
    ref_qc = json.loads((ref_dir / "config.json").read_text())["quantization_config"]
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
        _assert_same_tensor(name, ours[name], tensor, close=("input_scale", "k_scale", "v_scale"))
    _assert_configs_equal(ours_dir, ref_dir, family)


@pytest.mark.parametrize("family", ["llama", "llama_tied", "llama_mha"])
def test_int4_awq_checkpoint_matches_modelopt_in_layout(family: str, tmp_path: Path) -> None:
    """Names, dtypes, shapes and configs equal: both fold the scales of norm-fed linears
    into the norm and keep ``pre_quant_scale`` on ``o_proj`` / ``down_proj`` only. Those
    single linears are searched the same way (ModelOpt's ``awq_lite`` grid and loss) on the
    same batch, so their scales agree within float noise; the value differences of the
    rest are printed (``-s``): ours searches a fused group jointly, ModelOpt averages."""
    ours_dir, ref_dir = _both(family, "int4_awq", tmp_path)
    ours, ref = _tensors(ours_dir), _tensors(ref_dir)
    assert sorted(ours) == sorted(ref)
    for name in sorted(ref):
        assert (ours[name].dtype, ours[name].shape) == (ref[name].dtype, ref[name].shape), name
        if name.endswith("pre_quant_scale"):
            torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=0.0, msg=name)
        elif ours[name].is_floating_point():
            diff = float((ours[name].float() - ref[name].float()).abs().max())
            print(f"{family} {name}: max |ours - modelopt| = {diff:.3g}")
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


# ----------------------------------------------------------------------------- exportlm inspect


@pytest.mark.parametrize("recipe", ["fp8", "fp8+fp8_kv", "nvfp4"])
@pytest.mark.parametrize("family", ["llama", "llama_tied", "mixtral"])
def test_inspect_passes_modelopt_checkpoints(family: str, recipe: str, tmp_path: Path) -> None:
    """ModelOpt 0.47's own checkpoints break no error-level rule of ``exportlm inspect``."""
    from exportlm.inspection import inspect_checkpoint

    _, ref_dir = _both(family, recipe, tmp_path)
    report = inspect_checkpoint(ref_dir)
    assert report.ok, [f"[{f.rule}] {f.subject}: {f.message}" for f in report.errors]


def _ct_fp8(tmp_path: Path) -> Path:
    from exportlm.quant import quantize

    model = tiny_hf_model("llama", seed=0).eval()
    quantize(model, "fp8", calibrate=lambda m: m(_calibration_batch(m.config.vocab_size)))
    out: Path = exportlm.export_model(
        "hf_checkpoint", model, tmp_path / "ct", format="compressed-tensors"
    )
    return out


@pytest.mark.parametrize(
    ("rule", "edit"),
    [
        ("scale-missing", lambda t: t.pop("model.layers.0.self_attn.q_proj.input_scale")),
        ("leaked-buffer", lambda t: t.update({"model.layers.0.mlp._amax": torch.ones(())})),
    ],
)
def test_which_rules_transformers_enforces(rule: str, edit: Any, tmp_path: Path) -> None:
    """What transformers + compressed-tensors does on CPU with a corrupted FP8 checkpoint:
    ``from_pretrained`` loads both without raising (measured with transformers 5.24 and
    compressed-tensors 0.20); ``exportlm inspect`` refuses both."""
    pytest.importorskip("compressed_tensors")
    import transformers
    from safetensors.torch import load_file, save_file

    from exportlm.inspection import inspect_checkpoint

    out = _ct_fp8(tmp_path)
    shard = out / "model.safetensors"
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    assert rule in {f.rule for f in inspect_checkpoint(out).errors}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert loaded is not None  # the real loader accepted what the inspector refuses


# ------------------------------------------------ INT4 AWQ: weight reconstruction, layer by layer

_AWQ_NORM_OF = {
    "q_proj": "input_layernorm",
    "k_proj": "input_layernorm",
    "v_proj": "input_layernorm",
    "gate_proj": "post_attention_layernorm",
    "up_proj": "post_attention_layernorm",
}


def _awq_weight_errors(directory: Path, original: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per quantized linear, ``||W_eff - W|| / ||W||``: ``W_eff`` the dequantized INT4 weight
    times its AWQ scale, written as ``pre_quant_scale`` or folded into the norm (recovered
    as the saved norm weight over the original one)."""
    from exportlm.quant import QuantFormat, QuantizedTensor, dequantize

    tensors = _tensors(directory)
    errors: dict[str, float] = {}
    for key in sorted(k for k in tensors if k.endswith(".weight_scale")):
        name = key.removesuffix(".weight_scale")
        weight = original[f"{name}.weight"].float()
        scale = tensors[key]
        packed = QuantizedTensor(
            QuantFormat.INT4, tensors[f"{name}.weight"], scale, None,
            weight.shape[1] // scale.shape[1], tuple(weight.shape), torch.float32,
        )  # fmt: skip
        effective = dequantize(packed, torch.float32)
        if f"{name}.pre_quant_scale" in tensors:
            effective = effective * tensors[f"{name}.pre_quant_scale"].float()
        parent, leaf = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
        if leaf in _AWQ_NORM_OF:
            norm = f"{parent}.{_AWQ_NORM_OF[leaf]}.weight"
            effective = effective * (tensors[norm].float() / original[norm].float())
        errors[name] = float((effective - weight).norm() / weight.norm())
    return errors


@pytest.mark.parametrize("family", ["llama", "llama_tied", "llama_mha"])
def test_int4_awq_reconstructs_every_layer_no_worse_than_modelopt(
    family: str, tmp_path: Path
) -> None:
    """Per layer, our relative weight reconstruction error <= ModelOpt's (float noise aside):
    a fused group keeps our joint scale only where no member's error is worse than under
    ModelOpt's averaged per-linear scales."""
    ours_dir, ref_dir = _both(family, "int4_awq", tmp_path)
    overrides = {"num_key_value_heads": 4} if family == "llama_mha" else {}
    original = tiny_hf_model(family.removesuffix("_mha"), seed=0, **overrides).state_dict()
    ours, theirs = _awq_weight_errors(ours_dir, original), _awq_weight_errors(ref_dir, original)
    assert sorted(ours) == sorted(theirs)
    assert len(ours) == 14  # seven linears in each of the two layers
    table = "\n".join(f"  {n}: ours {ours[n]:.6f}, modelopt {theirs[n]:.6f}" for n in sorted(ours))
    worse = [n for n in ours if ours[n] > theirs[n] * (1 + 1e-4) + 1e-7]
    assert not worse, f"{family}: worse than ModelOpt on {worse}\n{table}"


# ------------------------------------------------------------------------------ mixed precision

#: Mixed precision: attention in FP8, the MLP in another recipe (ModelOpt: its FP8 config
#: with the MLP's weight / input quantizers overridden by the other config's entries).
MIXED_MLP_RECIPES = ["nvfp4", "int4_awq", "int8_wo"]


def _modelopt_mixed_config(mtq: Any, mlp: str) -> dict[str, Any]:
    other = _modelopt_config(mtq, mlp)
    overrides = [
        {**entry, "quantizer_name": f"*mlp{entry['quantizer_name']}"}
        for entry in other["quant_cfg"]
        if entry["quantizer_name"] in ("*weight_quantizer", "*input_quantizer")
    ]
    if not any(e["quantizer_name"] == "*mlp*input_quantizer" for e in overrides):
        overrides.append({"quantizer_name": "*mlp*input_quantizer", "enable": False})  # W-only
    fp8 = mtq.FP8_DEFAULT_CFG
    return {"quant_cfg": [*fp8["quant_cfg"], *overrides], "algorithm": other["algorithm"]}


def _both_mixed(family: str, mlp: str, tmp_path: Path) -> tuple[Path, Path]:
    """Ours (``{"*": "fp8", "*.mlp.*": mlp}``) and ModelOpt's mixed-precision checkpoint."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    modelopt_export = pytest.importorskip("modelopt.torch.export")
    from exportlm.quant import quantize

    model = tiny_hf_model(family, seed=0).eval()
    model.config.architectures = [type(model).__name__]
    batch = _calibration_batch(model.config.vocab_size)
    theirs = copy.deepcopy(model)

    def calibrate(m: Any) -> None:
        with torch.no_grad():
            m(batch)

    quantize(model, {"*": "fp8", "*.mlp.*": mlp}, calibrate=calibrate)
    ours_dir = exportlm.export_model("hf_checkpoint", model, tmp_path / "ours")
    mtq.quantize(theirs, _modelopt_mixed_config(mtq, mlp), forward_loop=calibrate)
    modelopt_export.export_hf_checkpoint(theirs, export_dir=tmp_path / "modelopt")
    return ours_dir, tmp_path / "modelopt"


def _assert_mixed_configs_equal(ours_dir: Path, ref_dir: Path) -> None:
    """Both files key for key (producer aside), ``config_groups`` numbering included."""
    for file, pick in (
        ("hf_quant_config.json", lambda d: d["quantization"]),
        ("config.json", lambda d: d["quantization_config"]),
    ):
        ours, ref = (json.loads((d / file).read_text()) for d in (ours_dir, ref_dir))
        ours, ref = pick(ours), pick(ref)
        for section in (ours, ref):
            section.pop("producer", None)
        assert ours == ref, file
    # ``config_groups`` are numbered by first appearance in ``quantized_layers``: same order
    ours_layers, ref_layers = (
        json.loads((d / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
        for d in (ours_dir, ref_dir)
    )
    assert list(ours_layers) == list(ref_layers)


@pytest.mark.parametrize(
    ("family", "mlp"),
    [
        *((f, m) for f in ("llama", "llama_tied") for m in MIXED_MLP_RECIPES),
        ("mixtral", "nvfp4"),  # ModelOpt's AWQ fails on fused experts: no int4_awq there
        ("qwen3_moe", "int8_wo"),
    ],
)
def test_mixed_precision_checkpoint_equals_modelopt(family: str, mlp: str, tmp_path: Path) -> None:
    """FP8 attention + another MLP recipe: ``quant_algo: MIXED_PRECISION`` with
    ``quantized_layers`` (and no ``exclude_modules``) in both files, equal key for key.
    Tensors: names, dtypes and shapes equal, bytes equal where the algorithm is
    deterministic. One known difference: ModelOpt's ``algorithm`` is global, so with
    ``INT4_AWQ_CFG``'s ``awq_lite`` it also smooths the FP8 attention and writes a
    ``pre_quant_scale`` its own config does not declare for an ``FP8`` layer; ours runs
    AWQ on the AWQ layers only."""
    ours_dir, ref_dir = _both_mixed(family, mlp, tmp_path)
    ours, ref = _tensors(ours_dir), _tensors(ref_dir)
    extra = {n for n in ref if ".self_attn." in n and n.endswith(".pre_quant_scale")}
    assert bool(extra) == (mlp == "int4_awq")
    assert sorted(ours) == sorted(set(ref) - extra)
    awq_smoothed = ("mlp.", "post_attention_layernorm", "self_attn.")
    for name in sorted(ours):
        tensor = ref[name]
        if mlp == "int4_awq" and any(part in name for part in awq_smoothed):
            # values differ: the AWQ searches, and ModelOpt's smoothed FP8 layers
            assert (ours[name].dtype, ours[name].shape) == (tensor.dtype, tensor.shape), name
            continue
        _assert_same_tensor(name, ours[name], tensor)
    config = json.loads((ours_dir / "hf_quant_config.json").read_text())["quantization"]
    assert config["quant_algo"] == "MIXED_PRECISION"
    assert {v["quant_algo"] for v in config["quantized_layers"].values()} == {
        "FP8",
        {"nvfp4": "NVFP4", "int4_awq": "W4A16_AWQ", "int8_wo": "W8A16"}[mlp],
    }
    _assert_mixed_configs_equal(ours_dir, ref_dir)
