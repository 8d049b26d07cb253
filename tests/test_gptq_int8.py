"""GPTQ for INT8 weights (``int8_gptq``) and GPTQ's one Hessian per input (issue 43, item 3).

``int8_gptq`` writes ``int8_wo``'s layouts (W8A16, one scale per output row) with codes from
GPTQ: it must reconstruct a linear's output better than round-to-nearest, read back in both
layouts as the fake-quantized model, hold a config compressed-tensors' classes validate and
bytes its ``pack-quantized`` compressor writes for the same codes, and run layer by layer in
the streamed export. The linears that read one input (q/k/v, gate/up) share one Hessian:
the codes are those of a Hessian of their own.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import exportlm
from exportlm.cli import main
from exportlm.errors import QuantizationError
from exportlm.models import tiny_hf_model
from exportlm.quant import dequantize, quantize, quantize_tensor
from tests._stream_models import llama_directory
from tests.test_gptq import _correlated, _linear
from tests.test_interop import _tensors


def _ids(model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (4, 32), generator=g)


def _row_codes(module: nn.Module) -> torch.Tensor:
    """The codes ``quantize`` left on a GPTQ linear (its dequantized weight / group scale)."""
    scale = module.weight_quantizer.gptq_scale.float()
    weight = module.weight.detach().float()
    rows, cols = weight.shape
    groups = weight.reshape(rows, scale.shape[1], -1) / scale[:, :, None]
    return groups.round().reshape(rows, cols)


def test_int8_gptq_reconstructs_the_output_better_than_round_to_nearest() -> None:
    x = _correlated(1024, 256)
    model = _linear(96, 256)
    weight = model[0].weight.detach().clone()
    rtn = dequantize(quantize_tensor(weight, "int8"), torch.float32)
    quantize(model, "int8_gptq", calibrate=lambda m: m(x))
    layer = model[0]
    gptq = dequantize(layer.weight_quantizer.quantize(layer.weight), torch.float32)
    reference = x @ weight.T
    error_rtn = float((x @ rtn.T - reference).norm())
    error_gptq = float((x @ gptq.T - reference).norm())
    print(f"||XW^T - XQ^T|| (int8): RTN {error_rtn:.4g}, GPTQ {error_gptq:.4g}")
    assert error_gptq < 0.8 * error_rtn
    # per-row scales, those of int8_wo's round-to-nearest (ModelOpt's amax / 127)
    torch.testing.assert_close(
        layer.weight_quantizer.gptq_scale[:, 0], weight.abs().amax(1) / 127, rtol=0, atol=0
    )
    with torch.no_grad():  # the fake-quantized model computes with what is exported
        torch.testing.assert_close(model(x), x @ gptq.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_int8_gptq_writes_int8_wo_layout_and_reads_back(fmt: str, tmp_path: Path) -> None:
    model = tiny_hf_model("llama", seed=0).eval()
    ids = _ids(model)
    quantize(model, "int8_gptq:actorder=none,dampening=0.05", calibrate=lambda m: m(ids))
    out = exportlm.export_model("hf_checkpoint", model, tmp_path / fmt, format=fmt)
    with torch.no_grad():
        want = model(ids).logits
    got = exportlm.load_exported("hf_checkpoint", out)(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # int8_wo's layout: the same tensor names, dtypes and shapes, other codes
    plain = tiny_hf_model("llama", seed=0).eval()
    quantize(plain, "int8_wo")
    wo = exportlm.export_model("hf_checkpoint", plain, tmp_path / "wo", format=fmt)
    ours, theirs = _tensors(out), _tensors(wo)
    assert {n: (t.dtype, t.shape) for n, t in ours.items()} == {
        n: (t.dtype, t.shape) for n, t in theirs.items()
    }
    codes = [n for n in ours if n.endswith(("weight_packed", "proj.weight"))]
    assert len(codes) == 14
    assert sum(not torch.equal(ours[n], theirs[n]) for n in codes) == 14  # GPTQ moved codes
    config = json.loads((out / "config.json").read_text())
    if fmt == "modelopt":
        hf_quant = json.loads((out / "hf_quant_config.json").read_text())
        assert hf_quant["quantization"]["quant_algo"] == "W8A16"
        assert "quantization_config" in config
    else:
        assert config["quantization_config"]["format"] == "pack-quantized"


def test_int8_gptq_compressed_tensors_config_and_bytes_are_the_library_s(tmp_path: Path) -> None:
    """compressed-tensors' classes validate the config (int8, symmetric, per channel) and its
    ``pack-quantized`` compressor writes our bytes from our dequantized weight and scales;
    the CLI's ``-o format=compressed-tensors`` takes its scales (``amax / 127.5`` in bf16)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    source = llama_directory(tmp_path, tied=False, layers=2)
    out = tmp_path / "ct"
    argv = ["export", "--target", "hf_checkpoint", "--model", str(source), "--quantize"]
    assert main([*argv, "int8_gptq", "-o", "format=compressed-tensors", "--out", str(out)]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    weights = scheme.weights
    assert weights is not None
    assert scheme.input_activations is None
    assert (weights.num_bits, weights.type, weights.strategy) == (8, "int", "channel")
    assert weights.symmetric
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    tensors = _tensors(out)
    packed = [n.removesuffix(".weight_packed") for n in tensors if n.endswith("weight_packed")]
    assert len(packed) == 2 * 7
    for name in packed:
        scale = tensors[f"{name}.weight_scale"]
        assert scale.dtype == torch.bfloat16
        assert scale.shape[1] == 1
        codes = _unpacked(tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_shape"])
        weight = codes.float() * scale.float()  # exact: an int8 code times a bf16 scale
        state = {"weight": weight, "weight_scale": scale}
        theirs = compressor.compress(state, scheme)
        for leaf in ("weight_packed", "weight_scale", "weight_shape"):
            mine, ref = tensors[f"{name}.{leaf}"], theirs[leaf].contiguous()
            assert (mine.dtype, mine.shape) == (ref.dtype, ref.shape), f"{name}.{leaf}"
            assert torch.equal(mine, ref), f"{name}.{leaf}"  # integer codes, copied scales
    exportlm.load_exported("hf_checkpoint", out)(torch.zeros(1, 4, dtype=torch.long))


def _unpacked(packed: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' 8-bit ``pack-quantized`` words unpacked to signed codes."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(packed, 8, torch.Size(shape.tolist()))


def test_cli_streams_int8_gptq_layer_by_layer(tmp_path: Path) -> None:
    """On float inputs the stream's per-layer Hessians are the in-memory ones: the same codes
    (at most 0.1% of the words may differ); the sequential default reads back."""
    source = llama_directory(tmp_path, tied=False)
    common = ["export", "--target", "hf_checkpoint", "--model", str(source)]
    common += ["--quantize", "int8_gptq"]
    assert main([*common, "--out", str(tmp_path / "mem")]) == 0
    argv = [*common, "--out", str(tmp_path / "float"), "--stream", "--stream-inputs", "float"]
    assert main(argv) == 0
    assert main([*common, "--out", str(tmp_path / "seq"), "--stream"]) == 0
    memory, streamed = _tensors(tmp_path / "mem"), _tensors(tmp_path / "float")
    assert sorted(memory) == sorted(streamed)
    codes = [n for n, t in memory.items() if t.dtype == torch.int8]
    assert len(codes) == 3 * 7
    for name in codes:
        assert (memory[name] == streamed[name]).float().mean() >= 0.999, name
    exportlm.load_exported("hf_checkpoint", tmp_path / "seq")(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("recipe", ["int4_gptq:group_size=32", "int8_gptq"])
def test_linears_reading_one_input_share_one_hessian_with_the_same_codes(
    recipe: str, caplog: pytest.LogCaptureFixture
) -> None:
    """q/k/v and gate/up share one Hessian (8 for 14 linears in two layers), and each
    linear's codes are those GPTQ gives it alone (only it quantized by GPTQ): the same
    float64 sums of the same rows, in the same order, in one process."""
    alone = {}
    for target in ("q_proj", "k_proj", "up_proj"):
        model = tiny_hf_model("llama", seed=0).eval()
        quantize(model, {"*": None, f"*layers.1.*.{target}": recipe}, calibrate=_calibrate)
        name = next(
            n
            for n, _ in model.named_modules()
            if n.endswith(f"layers.1.self_attn.{target}") or n.endswith(f"layers.1.mlp.{target}")
        )
        alone[name] = _row_codes(model.get_submodule(name))
    model = tiny_hf_model("llama", seed=0).eval()
    with caplog.at_level(logging.INFO, logger="exportlm.quant._gptq_apply"):
        quantize(model, recipe, calibrate=_calibrate)
    assert "GPTQ quantized 14 of 14 linear(s) from 8 input Hessian(s)" in caplog.text
    for name, codes in alone.items():
        assert torch.equal(_row_codes(model.get_submodule(name)), codes), name


def _calibrate(model: nn.Module) -> None:
    model(_ids(model))
    model(_ids(model)[:2, :16])


class _Diverging(nn.Module):
    """Two linears that read one tensor on the first forward and different ones later."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32, bias=False)
        self.b = nn.Linear(32, 32, bias=False)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.a(x) + self.b(x if self.calls == 1 else x * 2)


def test_a_linear_that_stops_sharing_its_input_is_refused_and_the_model_restored() -> None:
    model = _Diverging()
    weights = {n: p for n, p in model.named_parameters()}
    x = _correlated(64, 32)
    with pytest.raises(QuantizationError, match=r"GPTQ: b read the same input tensor as a"):
        quantize(model, "int8_gptq", calibrate=lambda m: (m(x), m(x)))
    assert all(p is weights[n] for n, p in model.named_parameters())
