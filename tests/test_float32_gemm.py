"""Half-precision matmuls of a calibration in float32 (``EXPORTLM_FLOAT32_GEMM``).

On a CPU without AVX512-BF16 or AMX a bfloat16 matmul is about 9x slower than the same
product in float32; ``quantize`` then multiplies in float32 and rounds to bfloat16, which is
what a bfloat16 GEMM computes up to its accumulation order. These tests force either
setting, so they hold on every CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from exportlm.errors import InvalidInputError, QuantizationError
from exportlm.models import tiny_hf_model
from exportlm.quant import _gemm, quantize
from tests._clip_checks import calibration_batches, quantized_tiny

#: Relative difference of activation maxima whose matmuls differ in accumulation order:
#: a bfloat16 step is 2**-8 = 0.4%; a few steps compound through the tiny model's layers.
RTOL = 0.03


def _bf16(family: str) -> nn.Module:
    return tiny_hf_model(family, seed=0).eval().to(torch.bfloat16)


@pytest.fixture
def products(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the matmuls run in float32 (by the mode's helper), in call order."""
    seen: list[str] = []
    original = _gemm.float32_product

    def counting(func: Callable[..., Any], args: tuple[Any, ...]) -> torch.Tensor:
        seen.append(getattr(func, "__name__", str(func)))
        return original(func, args)

    monkeypatch.setattr(_gemm, "float32_product", counting)
    return seen


def _quantized(
    family: str, recipe: str, setting: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[nn.Module, list[torch.Tensor]]:
    monkeypatch.setenv("EXPORTLM_FLOAT32_GEMM", setting)
    return quantized_tiny(family, recipe, torch.bfloat16)


def _amaxes(model: nn.Module) -> dict[str, torch.Tensor]:
    """The activation maxima calibration took (AWQ's scales are a search's choices: a
    bfloat16 step in the statistics can tip one)."""
    return {
        name: buffer.float()
        for name, buffer in model.named_buffers()
        if "input_quantizer" in name and name.endswith("amax")
    }


@pytest.mark.parametrize(
    ("family", "recipe"),
    [
        ("llama", "fp8+fp8_kv"),  # the KV cache quantized inside the attention function
        ("gpt_oss", "fp8"),  # eager attention with sinks, stacked experts with biases
        ("qwen3_moe", "int4_awq"),  # the AWQ search's scoring, experts
        ("llama", "int4_awq"),
    ],
)
def test_float32_products_calibrate_as_bfloat16_ones_do(
    family: str, recipe: str, monkeypatch: pytest.MonkeyPatch, products: list[str]
) -> None:
    fast, batches = _quantized(family, recipe, "1", monkeypatch)
    calibrating = list(products)
    plain, _ = _quantized(family, recipe, "0", monkeypatch)
    assert len(products) == len(calibrating)  # none with the setting off
    # the linears and eager attention's two batched matmuls
    assert {"linear", "matmul"} <= set(calibrating)
    ours, theirs = _amaxes(fast), _amaxes(plain)
    assert ours.keys() == theirs.keys()
    assert ours or recipe == "int4_awq"  # weight-only: no activation maximum
    for name, amax in ours.items():
        torch.testing.assert_close(amax, theirs[name], rtol=RTOL, atol=0, msg=name)
    # the quantized models are as far from the float model as each other: a bfloat16 step
    # in a statistic can move an INT4 code at a rounding boundary, not the error's size
    reference = _bf16(family)
    with torch.no_grad():
        want = reference(batches[0]).logits.float()
        errors = [
            float((m(batches[0]).logits.float() - want).norm() / want.norm()) for m in (fast, plain)
        ]
    assert len(products) == len(calibrating)  # a forward after quantize is the model's own
    assert abs(errors[0] - errors[1]) <= 0.25 * errors[1] + 1e-3, errors


def test_a_failed_calibration_leaves_no_mode_behind(
    monkeypatch: pytest.MonkeyPatch, products: list[str]
) -> None:
    monkeypatch.setenv("EXPORTLM_FLOAT32_GEMM", "1")
    model = _bf16("llama")

    def calibrate(m: nn.Module) -> None:
        m(calibration_batches(m.config.vocab_size)[0])
        raise RuntimeError("the data loader broke")

    with pytest.raises(QuantizationError, match="the data loader broke"):
        quantize(model, "fp8", calibrate=calibrate)
    assert products
    count = len(products)
    a = torch.ones(4, 4, dtype=torch.bfloat16)
    torch.matmul(a, a)
    assert len(products) == count


def test_float32_models_run_as_they_are(
    monkeypatch: pytest.MonkeyPatch, products: list[str]
) -> None:
    monkeypatch.setenv("EXPORTLM_FLOAT32_GEMM", "1")
    model = tiny_hf_model("llama", seed=0).eval()
    quantize(model, "fp8", calibrate=lambda m: m(calibration_batches(m.config.vocab_size)[0]))
    assert products == []


def test_the_streamed_export_calibrates_as_the_in_memory_one(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, products: list[str]
) -> None:
    """The stream computes each layer's next inputs outside ``quantize``: in the same
    arithmetic, or its float-input mode would not be the in-memory export."""
    from safetensors.torch import load_file

    import exportlm
    from tests._model_dirs import toy_model_dir

    monkeypatch.setenv("EXPORTLM_FLOAT32_GEMM", "1")
    source = toy_model_dir(tmp_path / "llama", dtype=torch.bfloat16)
    memory = exportlm.export_model("hf_checkpoint", source, tmp_path / "mem", recipe="fp8")
    streamed = exportlm.export_model(
        "hf_checkpoint",
        source,
        tmp_path / "seq",
        recipe="fp8",
        stream=True,
        calibration_inputs="float",
    )
    ours, theirs = (
        load_file(streamed / "model.safetensors"),
        load_file(memory / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    # the stream's own forwards (each layer's next inputs) multiply in float32 too
    import contextlib

    import exportlm.quant._quantize as quantize_module

    monkeypatch.setattr(quantize_module, "float32_matmuls", lambda _m: contextlib.nullcontext())
    products.clear()
    exportlm.export_model(
        "hf_checkpoint",
        source,
        tmp_path / "seq2",
        recipe="fp8",
        stream=True,
        calibration_inputs="float",
    )
    assert "linear" in products


def test_a_setting_that_is_none_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPORTLM_FLOAT32_GEMM", "fast")
    model = _bf16("llama")
    with pytest.raises(InvalidInputError, match=r"EXPORTLM_FLOAT32_GEMM='fast' is not a setting"):
        quantize(model, "fp8", calibrate=lambda m: m(torch.zeros(1, 4, dtype=torch.long)))
