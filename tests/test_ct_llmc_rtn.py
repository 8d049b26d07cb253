"""Round-to-nearest compressed-tensors checkpoints equal llm-compressor's, tensor for tensor.

``-o format=compressed-tensors`` quantizes with ``scales=compressed-tensors``: row and group
scales ``amax / 7.5`` (INT4), ``/ 127.5`` (INT8), ``/ 448`` (FP8) rounded once to the bf16
weight's dtype, and the codes of the quotient in that dtype, as llm-compressor 0.14 computes
them (``calculate_qparams``, ``_quantize``). On the same bf16 weights every tensor of the
checkpoint is llm-compressor's own (``tests/_llmc_rtn_worker.py``): codes, scales, shapes,
the unquantized tensors. Exact comparison: no matmul, the bytes are a pure function of the
weights. ``w8a8`` smooths the norm-fed linears first (SmoothQuant, its calibration): only
``o_proj`` / ``down_proj``, which it does not smooth, are compared.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import exportlm
from exportlm.cli import main
from exportlm.models import tiny_hf_model
from exportlm.quant import RECIPE_REGISTRY, QuantFormat, Recipe, quantize, register_recipe
from tests._fake_quant import checkpoint_tensors as _tensors
from tests._peers import llmcompressor_missing_reason, llmcompressor_python
from tests._stream_models import llama_directory

_WORKER = Path(__file__).resolve().parent / "_llmc_rtn_worker.py"
#: our recipe -> llm-compressor's scheme (the worker's SCHEMES), what is compared.
CASES = {
    "int8_wo": ("W8A16_CHANNEL", ""),
    "fp8_dynamic": ("FP8_DYNAMIC", ""),
    "int4_rtn": ("W4A16", ""),
    "w8a8": ("W8A8", "unsmoothed"),
}
UNSMOOTHED = ("o_proj", "down_proj")


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


@pytest.fixture
def int4_rtn() -> Iterator[None]:
    """INT4 round-to-nearest (the docs' worked recipe), registered in this process."""
    register_recipe(Recipe("int4_rtn", QuantFormat.INT4, group_sizes=(32, 64, 128)))
    yield
    RECIPE_REGISTRY.unregister("int4_rtn")


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The bf16 source directory and llm-compressor's checkpoints of it, one per scheme."""
    if (reason := llmcompressor_missing_reason()) is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("rtn")
    source = llama_directory(root, tied=False)
    schemes = [scheme for scheme, _ in CASES.values()]
    argv = [str(llmcompressor_python()), str(_WORKER), str(source), str(root / "llmc"), *schemes]
    subprocess.run(argv, check=True, capture_output=True, timeout=900)
    return source, root / "llmc"


@pytest.mark.interop
@pytest.mark.usefixtures("int4_rtn")
@pytest.mark.parametrize("recipe", list(CASES))
def test_the_checkpoint_equals_llm_compressors_tensor_for_tensor(
    recipe: str, peers: tuple[Path, Path], tmp_path: Path
) -> None:
    source, theirs_root = peers
    scheme, only = CASES[recipe]
    out = tmp_path / recipe
    argv = ["export", "--target", "hf_checkpoint", "--model", str(source), "--out", str(out)]
    assert main([*argv, "--quantize", recipe, "-o", "format=compressed-tensors", "-q"]) == 0
    ours, theirs = _tensors(out), _tensors(theirs_root / scheme)
    assert sorted(ours) == sorted(theirs)
    scales = [n for n in theirs if n.endswith("weight_scale")]
    assert scales
    assert all(theirs[n].dtype == ours[n].dtype == torch.bfloat16 for n in scales)
    compared = [n for n in theirs if not only or any(f".{p}." in n for p in UNSMOOTHED)]
    differ = [
        n
        for n in compared
        if ours[n].dtype != theirs[n].dtype or not torch.equal(_bytes(ours[n]), _bytes(theirs[n]))
    ]
    assert not differ, f"{len(differ)} of {len(compared)} tensors differ: {differ[:4]}"


def _bf16_toy() -> torch.nn.Module:
    model = tiny_hf_model("llama", seed=0).eval()
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model


@pytest.mark.parametrize(
    ("recipe", "hint"),
    [
        ("int4_gptq:group_size=32", "'int4_gptq:group_size=32,scales=compressed-tensors'"),
        ("int8_wo", "'int8_wo:scales=compressed-tensors'"),
        ("fp8_block:group_size=32", "recipe 'fp8_block:group_size=32' has no scale convention"),
    ],
)
def test_the_scale_warning_names_the_recipe_used_and_an_option_it_takes(
    recipe: str, hint: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The hint named the first recipe of the format ('int4_awq' for int4_gptq, 'int8_gptq'
    for int8_wo) and the option for recipes that do not take it (fp8_block)."""
    model = _bf16_toy()
    ids = torch.randint(
        0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)
    )
    quantize(model, recipe, calibrate=lambda m: m(ids))  # the default convention: ModelOpt's
    with caplog.at_level(logging.WARNING, logger="exportlm"):
        exportlm.export_model("hf_checkpoint", model, tmp_path / "ct", format="compressed-tensors")
    assert hint in caplog.text
    assert "int4_awq" not in caplog.text
