"""``quantize`` is all or nothing: a failed call leaves the model exactly as it was."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from exportlm.errors import QuantizationError
from exportlm.export import make_input_ids
from exportlm.models import DecoderModel, tiny_hf_model
from exportlm.quant import TensorQuantizer, is_quantized_module, quantize


class CalibrationBroke(RuntimeError):
    """What the user's calibrate function raises in these tests."""


@dataclass
class Snapshot:
    """A model's module tree, parameter objects and tensor values, for comparison."""

    tree: list[tuple[str, type[nn.Module], int]]
    parameters: dict[str, nn.Parameter]
    values: dict[str, torch.Tensor]
    attributes: dict[str, set[str]]

    @classmethod
    def of(cls, model: nn.Module) -> Snapshot:
        return cls(
            tree=[(name, type(m), id(m)) for name, m in model.named_modules()],
            parameters=dict(model.named_parameters()),
            values={k: v.detach().clone() for k, v in model.state_dict().items()},
            attributes={name: set(vars(m)) for name, m in model.named_modules()},
        )

    def assert_unchanged(self, model: nn.Module) -> None:
        now = Snapshot.of(model)
        assert now.tree == self.tree
        assert now.attributes == self.attributes
        assert now.parameters.keys() == self.parameters.keys()
        for name, param in self.parameters.items():
            assert now.parameters[name] is param, f"parameter {name} was replaced"
        assert now.values.keys() == self.values.keys()
        for name, value in self.values.items():
            # stored tensors, not computed ones: equal bit for bit (NaN included)
            assert _bits(now.values[name]) == _bits(value), f"{name} changed"
        assert not any(is_quantized_module(m) for m in model.modules())
        assert not any(isinstance(m, TensorQuantizer) for m in model.modules())


def _bits(tensor: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return tensor.dtype, tuple(tensor.shape), raw.numpy().tobytes()


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    out = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
    assert isinstance(out, torch.Tensor)
    return out


def _failing_calibrate(model: nn.Module) -> None:
    model(make_input_ids(64))  # some statistics are collected before the failure
    raise CalibrationBroke("the calibration data loader ran dry")


@pytest.mark.parametrize("recipe", ["fp8", "int4_awq", "fp8+fp8_kv"])
def test_a_raising_calibrate_leaves_the_model_as_it_was(recipe: str) -> None:
    model = DecoderModel(num_layers=1)
    ids = make_input_ids(64)
    before = Snapshot.of(model)
    reference = _logits(model, ids)
    with pytest.raises(QuantizationError, match="failed during calibration") as caught:
        quantize(model, recipe, calibrate=_failing_calibrate)
    message = str(caught.value)
    assert "CalibrationBroke: the calibration data loader ran dry" in message
    assert "restored the model" in message
    assert isinstance(caught.value.__cause__, CalibrationBroke)
    before.assert_unchanged(model)
    torch.testing.assert_close(_logits(model, ids), reference, rtol=0, atol=1e-6)
    quantized = quantize(model, recipe)  # not "already quantized"
    assert quantized is model
    assert any(is_quantized_module(m) for m in model.modules())


def test_non_finite_weights_are_refused_and_rolled_back() -> None:
    model = DecoderModel(num_layers=1)
    model.layers[0].mlp.up_proj.weight.data[0, 0] = math.nan
    before = Snapshot.of(model)
    with pytest.raises(QuantizationError, match="NaN or infinite") as caught:
        quantize(model, "fp8")
    assert "layers.0.mlp.up_proj.weight_quantizer.amax" in str(caught.value)
    notes = "".join(getattr(caught.value, "__notes__", []))
    assert "final check" in notes
    assert "restored the model" in notes
    before.assert_unchanged(model)
    model.layers[0].mlp.up_proj.weight.data[0, 0] = 0.0
    quantize(model, "fp8")
    assert is_quantized_module(model.layers[0].mlp.up_proj)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_non_finite_activations_are_refused_and_rolled_back(bad: float) -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    before = Snapshot.of(model)

    def calibrate(m: nn.Module) -> None:
        m(torch.full((2, 16), bad))

    with pytest.raises(QuantizationError, match=r"0\.input_quantizer\.amax"):
        quantize(model, "fp8", calibrate=calibrate)
    before.assert_unchanged(model)
    quantize(model, "fp8", calibrate=lambda m: m(torch.ones(2, 16)))
    assert is_quantized_module(model[0])


def test_calibration_that_misses_modules_rolls_back() -> None:
    model = DecoderModel(num_layers=1)
    before = Snapshot.of(model)
    with pytest.raises(QuantizationError, match="calibration never reached"):
        quantize(model, "fp8", calibrate=lambda m: None)
    before.assert_unchanged(model)


def test_a_failure_half_way_through_conversion_rolls_back(monkeypatch: Any) -> None:
    model = DecoderModel(num_layers=2)
    before = Snapshot.of(model)
    original = TensorQuantizer.__init__
    made = []

    def flaky_init(self: TensorQuantizer, *args: Any, **kwargs: Any) -> None:
        made.append(1)
        if len(made) == 7:  # a few modules are converted already
            raise MemoryError("out of memory while building a quantizer")
        original(self, *args, **kwargs)

    monkeypatch.setattr(TensorQuantizer, "__init__", flaky_init)
    with pytest.raises(QuantizationError, match="failed during conversion: MemoryError"):
        quantize(model, "fp8")
    monkeypatch.setattr(TensorQuantizer, "__init__", original)
    before.assert_unchanged(model)
    quantize(model, "fp8")


def test_fused_experts_get_their_class_back() -> None:
    model = tiny_hf_model("mixtral", 0, num_hidden_layers=1)
    before = Snapshot.of(model)
    with pytest.raises(QuantizationError, match="CalibrationBroke"):
        quantize(model, "fp8", calibrate=_failing_calibrate)
    before.assert_unchanged(model)
    quantize(model, "fp8")
    assert any(is_quantized_module(m) for m in model.modules())


class _Counting(nn.Module):
    """A model whose forward updates a buffer in place (like running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x)


def test_buffers_updated_by_calibration_forwards_are_restored() -> None:
    model = _Counting()
    before = Snapshot.of(model)

    def calibrate(m: nn.Module) -> None:
        m(torch.ones(1, 4))
        m.train(not m.training)
        raise CalibrationBroke("stop")

    with pytest.raises(QuantizationError, match="CalibrationBroke: stop"):
        quantize(model, "fp8", calibrate=calibrate)
    before.assert_unchanged(model)
    assert float(model.calls) == 0.0
    assert model.training


def test_interrupting_calibration_rolls_back_and_propagates() -> None:
    model = DecoderModel(num_layers=1)
    before = Snapshot.of(model)

    def interrupted(m: nn.Module) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize(model, "fp8", calibrate=interrupted)
    before.assert_unchanged(model)


@pytest.mark.parametrize("fails", [False, True])
def test_a_copy_never_touches_the_original(fails: bool) -> None:
    model = DecoderModel(num_layers=1)
    before = Snapshot.of(model)
    calibrate = _failing_calibrate if fails else None
    if fails:
        with pytest.raises(QuantizationError, match="CalibrationBroke"):
            quantize(model, "fp8", calibrate=calibrate, inplace=False)
    else:
        copy = quantize(model, "fp8", inplace=False)
        assert copy is not model
        assert is_quantized_module(copy.layers[0].mlp.up_proj)
    before.assert_unchanged(model)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_weights_the_awq_clip_clamped_in_place_are_written_back(
    family: str, monkeypatch: Any
) -> None:
    """AWQ's clip search clamps weights in place (a new Parameter kept the old one alive
    beside it until quantize returned: a streamed MoE layer's peak grew by a layer); a
    failure after it writes the journaled old values back, into the same objects."""
    import exportlm.quant._quantize as quantize_module

    model = tiny_hf_model(family, 0)
    before = Snapshot.of(model)
    batches = [make_input_ids(int(model.config.vocab_size), 2, 32, seed=s) for s in range(2)]
    clamped: list[str] = []

    def fail_after_the_clip(m: nn.Module) -> None:
        for name, value in m.state_dict().items():
            if name in before.values and _bits(value) != _bits(before.values[name]):
                clamped.append(name)
        raise CalibrationBroke("the disk filled up")

    monkeypatch.setattr(quantize_module, "check_calibrated", fail_after_the_clip)
    with pytest.raises(QuantizationError, match="the disk filled up"):
        quantize(model, "int4_awq", calibrate=lambda m: [m(b) for b in batches])
    assert any("proj" in name for name in clamped)  # the clip wrote into the weights
    if family == "qwen3_moe":
        assert any(name.endswith("experts.down_proj") for name in clamped)
    before.assert_unchanged(model)
