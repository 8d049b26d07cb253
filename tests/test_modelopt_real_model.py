"""ModelOpt 0.47's own checkpoints of the real model, judged like the loaders judge them.

SmolLM2-135M-Instruct (bf16, ``tests/_real_model.py``) quantized by ModelOpt itself
(``mtq.quantize`` with its ``INT8_SMOOTHQUANT_CFG`` / ``FP8_DEFAULT_CFG``) and written by
its ``export_hf_checkpoint``, as a user of ModelOpt does: ``exportlm inspect`` exits 0 on
them (its ``int8_sq`` checkpoint stores the SmoothQuant ``pre_quant_scale`` as BF16, which
an earlier rule refused though every loader reads it), and our loader reads them.
Calibration is one row of 64 tokens: the point is the layout, not the quality.

For ``int8_sq`` our loader computes the model ModelOpt calibrated (greedy agreement
below). ModelOpt's FP8 checkpoint of a bf16 model is not its own in-memory model: read
back, it agreed with ModelOpt's in-memory logits at 66% of the positions of these
random-token inputs (max difference 9.9), and on English text the two gave perplexity
25.745 (in memory) and 25.487 (its checkpoint in our runtime; ours 25.559, docs/quality.md).
Its export rounds a bf16 weight otherwise than its fake quantization does (our FP8 bytes
equal ModelOpt's for float32 models only, docs/checkpoint-format.md), so the FP8 case
checks that the checkpoint inspects clean and loads to finite logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import exportlm
from exportlm.cli import main

pytestmark = [pytest.mark.interop, pytest.mark.real_model]

# ModelOpt's fake quantization and our dequantizing runtime compute the same codes and
# scales in another order (bf16 rounding of the scaled input, the fused scale): in bf16
# the logits of a 30-layer model drift apart by up to a few units, never by what a misread
# scale does (a dropped or inverted scale moves them by tens). So the check is on the
# model's decisions: the greedy next token agrees at almost every position.
MIN_ARGMAX_AGREEMENT = 0.9


def _modelopt_checkpoint(source: Path, config_name: str, out: Path) -> tuple[Any, torch.Tensor]:
    """ModelOpt's quantized model (in memory) and the ids it is compared on; ``out`` its export."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    modelopt_export = pytest.importorskip("modelopt.torch.export")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    generator = torch.Generator().manual_seed(0)
    calib = torch.randint(0, model.config.vocab_size, (1, 64), generator=generator)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator)

    def calibrate(m: Any) -> None:
        with torch.no_grad():
            m(calib)

    mtq.quantize(model, getattr(mtq, config_name), forward_loop=calibrate)
    with torch.no_grad():
        expected = model(ids).logits.float()
    modelopt_export.export_hf_checkpoint(model, export_dir=out)
    return expected, ids


@pytest.mark.parametrize(
    ("config_name", "is_its_model"), [("INT8_SMOOTHQUANT_CFG", True), ("FP8_DEFAULT_CFG", False)]
)
def test_modelopt_checkpoint_of_the_real_model_inspects_and_loads(
    real_model_dir: Path,
    config_name: str,
    is_its_model: bool,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "modelopt"
    expected, ids = _modelopt_checkpoint(real_model_dir, config_name, out)

    assert main(["inspect", str(out)]) == 0, capsys.readouterr().out

    runtime = exportlm.load_exported("hf_checkpoint", out)
    with torch.no_grad():
        actual = torch.as_tensor(runtime(ids)).float()
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    agreement = float((actual.argmax(-1) == expected.argmax(-1)).float().mean())
    gap = float((actual - expected).abs().max())
    print(f"{config_name}: argmax agreement {agreement:.3f}, max |logit diff| {gap:.3g}")
    if is_its_model:
        assert agreement >= MIN_ARGMAX_AGREEMENT, (agreement, gap)
