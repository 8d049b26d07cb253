"""INT4 AWQ in the compressed-tensors convention: every scale folded into the op before it.

A norm takes the scales of ``q/k/v`` and ``gate/up``; ``v_proj`` takes ``o_proj``'s when its
output channels are ``o_proj``'s inputs (no grouped-query attention), ``up_proj`` takes
``down_proj``'s; a linear with no such op is round-to-nearest. So the compressed-tensors
checkpoint quantizes every linear (before, the export refused ``o_proj`` / ``down_proj``
unless they were excluded).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import exportlm
from exportlm.cli import main
from exportlm.models import tiny_hf_model
from exportlm.quant import QuantLinear, quantize
from exportlm.quant._awq_search import CT_AWQ_ALPHAS, awq_scale, awq_weight_scale

CT_AWQ = "int4_awq:scales=compressed-tensors"
#: The float function of the folded model against the original (weights unquantized):
#: a scale times its reciprocal per row, in float32 (measured max |diff| ~1e-6 on logits).
FLOAT_ATOL = 1e-4


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def _quantized(kv_heads: int) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """(the CT-AWQ quantized tiny llama, the same model unquantized, a batch). The folds
    alone: the clip search (on by default) stores the weights it clips clamped, so the
    float function would no longer be the original's (tests/test_awq_clip.py)."""
    model = tiny_hf_model("llama", seed=0, num_key_value_heads=kv_heads).eval()
    original = tiny_hf_model("llama", seed=0, num_key_value_heads=kv_heads).eval()
    batch = _batch(model.config.vocab_size)
    quantize(model, f"{CT_AWQ},clip=false", calibrate=lambda m: m(batch))
    return model, original, batch


def test_o_and_down_scales_fold_into_v_and_up_rows_without_gqa() -> None:
    model, original, batch = _quantized(kv_heads=4)  # 4 heads: v's outputs are o's inputs
    for layer, before in zip(model.model.layers, original.model.layers, strict=True):
        for pred, cons, pred_before in (
            (layer.self_attn.v_proj, layer.self_attn.o_proj, before.self_attn.v_proj),
            (layer.mlp.up_proj, layer.mlp.down_proj, before.mlp.up_proj),
        ):
            scale = cons.input_quantizer.folded_pre_quant_scale
            assert cons.input_quantizer.pre_quant_scale is None
            assert scale is not None
            assert scale.shape == (cons.in_features,)
            assert not torch.equal(scale, torch.ones_like(scale))  # a searched scale
            # the predecessor's rows absorbed exactly the scale (one float32 product each)
            assert torch.equal(pred.weight, pred_before.weight * scale[:, None])
        # gate_proj (SiLU) and q/k (softmax) fail the replay check: their rows are untouched
        for name in ("mlp.gate_proj", "self_attn.q_proj", "self_attn.k_proj"):
            assert torch.equal(layer.get_submodule(name).weight, before.get_submodule(name).weight)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.weight_quantizer.enabled = False
    with torch.no_grad():
        got, want = model(batch).logits, original(batch).logits
    torch.testing.assert_close(got, want, atol=FLOAT_ATOL, rtol=0)


def test_under_gqa_o_proj_keeps_no_scale_and_is_round_to_nearest() -> None:
    model, original, _ = _quantized(kv_heads=2)  # v: 64 outputs, o: 128 inputs
    for layer, before in zip(model.model.layers, original.model.layers, strict=True):
        o = layer.self_attn.o_proj.input_quantizer
        assert o.pre_quant_scale is None
        assert o.folded_pre_quant_scale is None
        assert torch.equal(layer.self_attn.v_proj.weight, before.self_attn.v_proj.weight)
        assert layer.mlp.down_proj.input_quantizer.folded_pre_quant_scale is not None


def test_the_modelopt_convention_keeps_o_and_down_pre_quant_scale() -> None:
    model = tiny_hf_model("llama", seed=0, num_key_value_heads=4).eval()
    batch = _batch(model.config.vocab_size)
    quantize(model, "int4_awq", calibrate=lambda m: m(batch))
    layer = model.model.layers[0]
    for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
        assert linear.input_quantizer.pre_quant_scale is not None
        assert linear.input_quantizer.folded_pre_quant_scale is None


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cli_compressed_tensors_w4a16_quantizes_every_linear(
    kv_heads: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No ``--exclude``: before, this export refused o_proj / down_proj's unfoldable scales."""
    model_dir = tmp_path / "model"
    tiny_hf_model("llama", seed=0, num_key_value_heads=kv_heads).save_pretrained(model_dir)
    data = tmp_path / "calib.txt"
    data.write_text("\n".join(f"sample text number {i} of the calibration" for i in range(16)))
    out = tmp_path / "ct"
    argv = ["export", "--target", "hf_checkpoint", "--model", str(model_dir), "--out", str(out)]
    argv += ["--quantize", "int4_awq:group_size=64", "-o", "format=compressed-tensors"]
    argv += ["--calib-data", str(data), "--calib-samples", "4", "--calib-seq-len", "16"]
    assert main([*argv, "--json", "--verify"]) == 0
    assert json.loads(capsys.readouterr().out)["verify"]["passed"]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" in config["ignore"]
    assert not [name for name in config["ignore"] if ".layers." in name]
    tensors = load_file(out / "model.safetensors")
    assert not [n for n in tensors if "pre_quant_scale" in n]
    packed = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_packed")}
    linears = {f"model.layers.{i}.{p}" for i in range(2) for p in _PROJECTIONS}
    assert packed == linears
    runtime = exportlm.load_exported("hf_checkpoint", out)
    assert torch.isfinite(torch.as_tensor(runtime(torch.tensor([[1, 2, 3]])))).all()


_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def test_norm_groups_take_a_joint_candidate_of_the_finer_grid() -> None:
    """The convention's search (llm-compressor's grid, the joint loss alone): the scale a
    norm absorbs for q/k/v and gate/up is ``1 / s(alpha)`` of the group's fused weight for
    an ``alpha`` of :data:`CT_AWQ_ALPHAS`, not ModelOpt's average of per-linear scales."""
    model = tiny_hf_model("llama", seed=0, num_key_value_heads=4).eval()
    original = tiny_hf_model("llama", seed=0, num_key_value_heads=4).eval()
    batch = _batch(model.config.vocab_size)
    inputs: dict[str, torch.Tensor] = {}
    handles = [
        original.get_submodule(f"model.layers.{i}.{first}").register_forward_pre_hook(
            lambda _m, args, key=f"{i}.{first}": inputs.__setitem__(key, args[0])
        )
        for i in range(len(original.model.layers))
        for first in ("self_attn.q_proj", "mlp.gate_proj")
    ]
    with torch.no_grad():
        original(batch)
    for handle in handles:
        handle.remove()
    quantize(model, CT_AWQ, calibrate=lambda m: m(batch))
    picked = set()
    for key, x in inputs.items():
        layer, first = key.split(".", 1)
        parent = first.rsplit(".", 1)[0]
        members = (
            ["q_proj", "k_proj", "v_proj"] if parent == "self_attn" else ["gate_proj", "up_proj"]
        )
        linears = [original.get_submodule(f"model.layers.{layer}.{parent}.{m}") for m in members]
        quantized = model.get_submodule(f"model.layers.{key}")
        scale = quantized.input_quantizer.folded_pre_quant_scale
        assert scale is not None
        act = x.reshape(-1, x.shape[-1]).abs().mean(dim=0)
        wscale = awq_weight_scale(
            [m.weight for m in linears], quantized.weight_quantizer.block_size
        )
        candidates = [(1.0 / awq_scale(act, wscale, a)).float() for a in CT_AWQ_ALPHAS]
        hits = [
            a
            for a, c in zip(CT_AWQ_ALPHAS, candidates, strict=True)
            if torch.allclose(scale, c, rtol=1e-5)
        ]
        assert hits, f"{key}: the folded scale is none of the grid's candidates"
        picked.update(hits)
    # the grid's own steps were taken, not only the values it shares with ModelOpt's
    assert picked - {0.0, 0.5, 1.0}, picked
