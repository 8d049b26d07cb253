"""INT4 AWQ and W4AFP8 on stacked MoE experts in the compressed-tensors layout.

transformers 5 fuses the experts of Mixtral / Qwen-MoE / GPT-OSS / Llama4 into 3-D
parameters; the checkpoint names them per expert (``experts.{e}.gate_proj.weight_packed``),
as llm-compressor writes its linearized experts and vLLM's fused-MoE loader reads them.
compressed-tensors has no tensor for an AWQ scale: each expert's ``down_proj`` scale folds
into its ``up`` rows (llm-compressor's ``up_proj -> down_proj`` mapping), where the gate is
linear in ``up``; GPT-OSS's ``down`` is round-to-nearest; ``gate/up`` takes the one scale the
MoE block's input norm carries (shared with the router: llm-compressor's norm -> router +
experts mapping; Llama4, whose experts read the routed input, round-to-nearest). Before, the export
refused the experts with a hint to use the option already applied (int4_awq), and ``quantize``
refused them (w4afp8).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import exportlm
from exportlm.cli import main
from exportlm.errors import UnsupportedFormatError
from exportlm.models import tiny_hf_model
from exportlm.quant import QuantRecipe, TensorQuantizer, quantize
from exportlm.quant.formats import CHECKPOINT_LAYOUTS
from exportlm.stream import export_streaming
from tests._fake_quant import assert_pack_quantized_as_compressed_tensors
from tests._fake_quant import checkpoint_tensors as _tensors
from tests._fake_quant import ct_group as _group
from tests._stream_models import assert_same_checkpoint, family_directory, in_memory_export
from tests._vllm import vllm_python as _vllm_python

CT = "compressed-tensors"
LAYOUT = CHECKPOINT_LAYOUTS[CT]
#: (family, where its experts are) of the toy families with stacked experts INT4 takes
EXPERTS = {
    "mixtral": "mlp.experts",
    "qwen2_moe": "mlp.experts",
    "qwen3_moe": "mlp.experts",
    "gpt_oss": "mlp.experts",
    "llama4": "feed_forward.experts",
}
#: The folded model's float function against the original's (every quantizer off): a scale
#: times its reciprocal per channel in float32 (measured max |diff| ~1e-6 on the logits).
FLOAT_ATOL = 1e-4
#: Our runtime dequantizes the very codes: the forwards differ by float noise only.
RUNTIME_ATOL = 1e-5


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def _quantized(family: str, recipe: str = "int4_awq") -> tuple[Any, Any, torch.Tensor]:
    """(the model quantized in the compressed-tensors convention, the original, a batch)."""
    model = tiny_hf_model(family, seed=0).eval()
    original = tiny_hf_model(family, seed=0).eval()
    batch = _batch(model.config.vocab_size)
    quantize(model, QuantRecipe.parse(recipe).for_layout(CT), calibrate=lambda m: m(batch))
    return model, original, batch


def _canonical(experts: Any, stored: torch.Tensor) -> torch.Tensor:
    """An original stacked weight in the quantized wrapper's canonical ``[E, out, in]`` view."""
    return stored.transpose(-1, -2) if experts.transposed else stored


def _layer_experts(model: nn.Module, family: str) -> nn.Module:
    return model.get_submodule(f"model.layers.0.{EXPERTS[family]}")


@pytest.mark.parametrize("family", ["qwen3_moe", "llama4"])
def test_the_cli_writes_every_expert_linear_as_compressed_tensors_packs_it(
    family: str, tmp_path: Path
) -> None:
    """Before: exit 1, "cannot store its int4 'pre_quant_scale' ... quantize with
    'int4_awq:scales=compressed-tensors' (which export -o format=compressed-tensors chooses)"."""
    pytest.importorskip("compressed_tensors.quantization")

    out = tmp_path / "ckpt"
    argv = ["export", "--target", "hf_checkpoint", "--model", f"hf:{family}", "--out", str(out)]
    assert main([*argv, "--quantize", "int4_awq", "-o", f"format={CT}", "-q"]) == 0
    tensors = _tensors(out)
    model = tiny_hf_model(family, seed=0)
    experts, layers = model.config.num_local_experts, model.config.num_hidden_layers
    packed = {n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")}
    assert {
        f"model.layers.{i}.{EXPERTS[family]}.{e}.{p}"
        for i in range(layers)
        for e in range(experts)
        for p in ("gate_proj", "up_proj", "down_proj")
    } <= packed
    assert not [n for n in tensors if n.endswith("pre_quant_scale")]
    experts_ = sorted(n for n in packed if ".experts." in n)
    assert_pack_quantized_as_compressed_tensors(tensors, experts_, out, "int4")


def _norm_scale(model: nn.Module, original: nn.Module, family: str) -> torch.Tensor:
    """``s`` of the MoE block's input (the original norm's weight over the folded one): all
    ones where the block's input was not smoothed (Llama4)."""
    name = "model.layers.0.post_attention_layernorm.weight"
    return original.get_parameter(name) / model.get_parameter(name)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "llama4"])
def test_down_scales_fold_into_up_rows_and_gate_up_takes_the_norms_scale(family: str) -> None:
    # the folds alone: the clip search stores the attention weights it clips clamped
    model, original, batch = _quantized(family, "int4_awq:clip=false")
    experts, before = _layer_experts(model, family), _layer_experts(original, family)
    for proj in ("gate_up_proj", "down_proj"):
        assert experts.input_quantizer_of(proj).pre_quant_scale is None
    s = _norm_scale(model, original, family).detach()  # [H]: one scale for every expert
    assert torch.equal(s, torch.ones_like(s)) == (family == "llama4")
    gate, up = experts.split_gate_up(experts.canonical_weight("gate_up_proj"), dim=-2)
    gate0, up0 = experts.split_gate_up(_canonical(experts, before.gate_up_proj), dim=-2)
    torch.testing.assert_close(gate, gate0 * s, rtol=1e-5, atol=1e-8)  # columns: the norm's
    ratio = up / (up0 * s)  # [E, I, H]: one searched scale per expert and intermediate channel
    scale = ratio[..., :1]
    torch.testing.assert_close(ratio, scale.expand_as(ratio), rtol=1e-5, atol=0)
    assert not torch.equal(scale, torch.ones_like(scale))
    down = experts.canonical_weight("down_proj")
    down0 = _canonical(experts, before.down_proj)
    torch.testing.assert_close(down * scale.transpose(1, 2), down0, rtol=1e-5, atol=1e-7)
    for quantizer in model.modules():
        if isinstance(quantizer, TensorQuantizer):
            quantizer.enabled = False
    with torch.no_grad():
        got, want = model(batch).logits, original(batch).logits
    torch.testing.assert_close(got, want, atol=FLOAT_ATOL, rtol=0)


def test_gpt_oss_keeps_its_down_unscaled_as_its_gate_is_not_linear_in_up() -> None:
    """``(clamp(up) + 1) * glu``: no scale folds into ``up``, its ``down`` is round-to-nearest;
    ``gate_up`` takes the norm's scale on its input columns (stored ``[E, H, 2I]``)."""
    model, original, _ = _quantized("gpt_oss")
    experts, before = _layer_experts(model, "gpt_oss"), _layer_experts(original, "gpt_oss")
    for proj in ("gate_up_proj", "down_proj"):
        assert experts.input_quantizer_of(proj).pre_quant_scale is None
    assert torch.equal(experts.down_proj, before.down_proj)
    s = _norm_scale(model, original, "gpt_oss").detach()
    assert not torch.equal(s, torch.ones_like(s))
    want = before.gate_up_proj * s[:, None]
    torch.testing.assert_close(experts.gate_up_proj, want, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_the_checkpoint_loads_back_with_the_fake_quant_logits(family: str, tmp_path: Path) -> None:
    model, _, batch = _quantized(family)
    out = Path(exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt", format=CT))
    runtime = exportlm.load_exported("hf_checkpoint", out)
    with torch.no_grad():
        want = model(batch).logits
        got = torch.as_tensor(runtime(batch))
    torch.testing.assert_close(got, want, atol=RUNTIME_ATOL, rtol=0)


def test_w4afp8_quantizes_stacked_experts_and_writes_them(tmp_path: Path) -> None:
    """Before: ``quantize`` refused the experts (a per-expert AWQ scale before FP8 inputs)."""
    model, _, batch = _quantized("qwen3_moe", "w4afp8")
    out = Path(exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt", format=CT))
    tensors = _tensors(out)
    assert "model.layers.1.mlp.experts.3.down_proj.weight_packed" in tensors
    assert not [n for n in tensors if n.endswith(("pre_quant_scale", "input_scale"))]
    assert _group(out)["input_activations"]["strategy"] == "token"
    runtime = exportlm.load_exported("hf_checkpoint", out)
    with torch.no_grad():
        want = model(batch).logits
        got = torch.as_tensor(runtime(batch))
    torch.testing.assert_close(got, want, atol=RUNTIME_ATOL, rtol=0)


def test_w4afp8_in_modelopts_convention_is_refused_naming_the_one_that_works() -> None:
    model = tiny_hf_model("qwen3_moe", seed=0).eval()
    pattern = r"per-expert AWQ scale.*'w4afp8:scales=compressed-tensors'"
    with pytest.raises(UnsupportedFormatError, match=pattern):
        quantize(model, "w4afp8:scales=modelopt")
    assert not any(isinstance(m, TensorQuantizer) for m in model.modules())
    quantize(model, "w4afp8:scales=compressed-tensors")  # the way out the message names


def test_the_streamed_export_is_the_in_memory_one_byte_for_byte(tmp_path: Path) -> None:
    src = family_directory(tmp_path, "qwen3_moe")
    expected = in_memory_export(src, tmp_path / "memory", "int4_awq", shard="100KB", format=CT)
    streamed = export_streaming(
        src,
        tmp_path / "streamed",
        recipe="int4_awq",
        format=CT,
        max_shard_size="100KB",
        calibration_inputs="float",
    )
    assert_same_checkpoint(expected, streamed)


#: vLLM's own selection of the fused-MoE method of a compressed-tensors config
#: (``CompressedTensorsMoEMethod.get_moe_method``: the scheme of ``{layer}.0.{gate,up,down}_proj``),
#: its kernels' constructors recorded instead of run (they pick a CUDA / CPU backend).
_VLLM_MOE = """
import json, sys
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
    compressed_tensors_moe as moe, compressed_tensors_moe_wna16 as wna16,
    compressed_tensors_moe_w4a8_fp8 as w4a8)
picked = {}
def record(self, weights, inputs, moe_config):
    kinds = None if inputs is None else [inputs.type, inputs.strategy]
    picked.update(method=type(self).__name__, bits=weights.num_bits, group=weights.group_size,
                  inputs=kinds and [str(getattr(v, "value", v)) for v in kinds])
wna16.CompressedTensorsWNA16MoEMethod.__init__ = record
w4a8.CompressedTensorsW4A8Fp8MoEMethod.__init__ = record
class RoutedExperts:  # vLLM's fused-MoE layer: the CT config matches it by class name
    ckpt_gate_proj_name, ckpt_up_proj_name, ckpt_down_proj_name = sys.argv[3].split(",")
    moe_config = None
config = CompressedTensorsConfig.from_config(json.load(open(sys.argv[1]))["quantization_config"])
with set_current_vllm_config(VllmConfig()):
    moe.CompressedTensorsMoEMethod.get_moe_method(config, RoutedExperts(), sys.argv[2])
print(json.dumps(picked))
"""


#: family -> (its first experts layer, its checkpoint's gate, up, down names), as vLLM names them
_VLLM_NAMES = {
    "mixtral": ("model.layers.0.block_sparse_moe.experts", "w1,w3,w2"),
    "qwen3_moe": ("model.layers.0.mlp.experts", "gate_proj,up_proj,down_proj"),
}


@pytest.mark.parametrize(
    ("recipe", "family", "method", "inputs"),
    [
        ("int4_awq", "mixtral", "CompressedTensorsWNA16MoEMethod", None),
        ("w4afp8", "qwen3_moe", "CompressedTensorsW4A8Fp8MoEMethod", ["float", "token"]),
    ],
)
def test_vllm_picks_its_int4_fused_moe_method_for_the_experts(
    recipe: str, family: str, method: str, inputs: Any, tmp_path: Path
) -> None:
    """Parsing only (no kernel runs): the experts are quantized, not ignored, under the names
    the checkpoint gives them (vLLM's ``ckpt_*_proj_name``: Mixtral's ``w1`` / ``w3`` / ``w2``)."""
    python = _vllm_python()
    model, _, _ = _quantized(family, recipe)
    out = Path(exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt", format=CT))
    tensors = _tensors(out)
    layer, names = _VLLM_NAMES[family]
    assert all(f"{layer}.0.{p}.weight_packed" in tensors for p in names.split(","))
    done = subprocess.run(
        [python, "-c", _VLLM_MOE, str(out / "config.json"), layer, names],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    picked = json.loads(done.stdout.strip().splitlines()[-1])
    assert picked == {"method": method, "bits": 4, "group": 128, "inputs": inputs}


def test_dbrx_experts_in_compressed_tensors_are_refused_naming_an_exclusion_that_works(
    tmp_path: Path,
) -> None:
    """DBRX's own fused layout holds FP8 only and compressed-tensors has no names for it: the
    refusal (before any calibration) names a pattern for every layer's experts, not the
    ``fp8`` override the layout cannot write (before: "Quantize it with 'fp8' ... or exclude
    it (exclude=['transformer.blocks.0.ffn.experts'])", block 0's only)."""
    model = tiny_hf_model("dbrx", seed=0).eval()
    recipe = QuantRecipe.parse("int4_awq").for_layout(CT)
    pattern = r"Exclude it \(exclude=\['\*\.ffn\.experts'\], --exclude '\*\.ffn\.experts'\)"
    with pytest.raises(UnsupportedFormatError, match=pattern):
        quantize(model, recipe, calibrate=lambda m: pytest.fail("calibrated before refusing"))
    assert not any(isinstance(m, TensorQuantizer) for m in model.modules())
    batch = _batch(model.config.vocab_size)
    quantize(model, recipe, exclude=["*.ffn.experts"], calibrate=lambda m: m(batch))
    out = Path(exportlm.export_model("hf_checkpoint", model, tmp_path / "ckpt", format=CT))
    assert "transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight_packed" in _tensors(out)


#: family -> the modules of its first MoE block that read the block's input besides the
#: experts: the routers (unquantized), Qwen2-MoE's shared expert and its gate (its
#: ``up_proj`` too, whose rows also carry its ``down_proj``'s scale: the float-model check
#: above covers it)
_READERS = {
    "mixtral": ["mlp.gate"],
    "qwen3_moe": ["mlp.gate"],
    "qwen2_moe": [
        "mlp.gate",
        "mlp.shared_expert_gate",
        "mlp.shared_expert.gate_proj",
    ],
    "gpt_oss": ["mlp.router"],
}


@pytest.mark.parametrize("family", sorted(_READERS))
def test_the_moe_norm_carries_one_scale_the_router_and_shared_expert_absorb(family: str) -> None:
    """Before: the norm kept its weight and ``gate_up`` was round-to-nearest. Now the norm
    is divided by one searched scale and every reader of its output multiplies its input
    columns by it: the router's logits (and a shared expert's float products) are unchanged.
    The folds alone (clip=false): the clip search's clamped ``o_proj`` (round-to-nearest
    under GQA, clipped on its inputs) feeds this block, and on Qwen2-MoE's toy the block's
    search then keeps no scale (its round-to-nearest point wins), leaving no fold to check."""
    model, original, _ = _quantized(family, "int4_awq:clip=false")
    norm = "model.layers.0.post_attention_layernorm"
    s = _norm_scale(model, original, family).detach()
    assert not torch.equal(s, torch.ones_like(s))
    x = torch.randn(8, s.shape[0], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        h, h0 = model.get_submodule(norm)(x), original.get_submodule(norm)(x)
        for reader in _READERS[family]:
            name = f"model.layers.0.{reader}"
            got = nn.functional.linear(h, model.get_parameter(f"{name}.weight"))
            want = nn.functional.linear(h0, original.get_parameter(f"{name}.weight"))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if family == "gpt_oss":  # the router's bias is not scaled: ``x W^T + b``
        bias = "model.layers.0.mlp.router.bias"
        assert torch.equal(model.get_parameter(bias), original.get_parameter(bias))


#: Smoothed ``gate_up`` against round-to-nearest on held-out tokens: the MSE of the logits
#: against the float model may not grow by more than this factor. Measured (8 x 64
#: calibration tokens, another 8 x 64 to evaluate): Mixtral 0.9947, Qwen3-MoE 0.9988.
_NO_WORSE = 1.02


def _logits_mse(family: str, monkeypatch: pytest.MonkeyPatch, smooth: bool) -> float:
    model = tiny_hf_model(family, seed=0).eval()
    reference = tiny_hf_model(family, seed=0).eval()
    vocab = model.config.vocab_size
    calib = torch.randint(0, vocab, (8, 64), generator=torch.Generator().manual_seed(1))
    held_out = torch.randint(0, vocab, (8, 64), generator=torch.Generator().manual_seed(2))
    with monkeypatch.context() as patch:
        if not smooth:  # today's round-to-nearest gate_up, the rest of the recipe the same
            patch.setattr("exportlm.quant._calibration_steps.smooth_moe_inputs", lambda *a, **k: 0)
        recipe = QuantRecipe.parse("int4_awq").for_layout(CT)
        quantize(model, recipe, calibrate=lambda m: m(calib))
    with torch.no_grad():
        return float((model(held_out).logits - reference(held_out).logits).pow(2).mean())


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_smoothing_gate_up_is_no_worse_than_round_to_nearest(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rtn = _logits_mse(family, monkeypatch, smooth=False)
    smoothed = _logits_mse(family, monkeypatch, smooth=True)
    assert smoothed <= rtn * _NO_WORSE, (smoothed, rtn)
