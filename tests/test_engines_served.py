"""Our artifacts served by the real engines, each in its own interpreter, through
:func:`exportlm.engines.serve_and_compare` (the ``served`` check's comparison).

Each engine's interpreter comes from ``EXPORTLM_ENGINE_<NAME>`` (``make test-engines``
passes the venvs ``make engines`` builds) or from this interpreter where the engine
imports; otherwise the test skips and says to run ``make engines``.

The eager reference is the toy model itself (the fake-quantized model for a quantized
checkpoint), each prompt alone and unpadded; the engines get one left-padded batch of
3 prompts (3, 7 and 12 tokens) chosen without near-ties, 8 new tokens.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import exportlm
from exportlm.engines import (
    MIN_MARGIN,
    Outcome,
    Served,
    Verdict,
    artifact_kind,
    choose_prompts,
    find_interpreter,
    get_engine,
    serve_and_compare,
)
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize
from tests._exports import shared_export

#: Larger weights than the family default, so the toy's next-token distribution has
#: clear winners (default init: top-2 margins of 1e-3 that bf16 rounding can swap).
OVERRIDES = {"initializer_range": 0.3}

#: Runs a real engine: selected by `make test-engines` (`-m engines`).
pytestmark = pytest.mark.engines


def _python(name: str, *imports: str) -> Path:
    found = find_interpreter(name)
    if found.path is None:
        pytest.skip(f"{found.reason}. Run `make engines` (or `make test-engines`)")
    if imports:
        code = f"import {', '.join(imports)}"
        probe = subprocess.run([str(found.path), "-E", "-s", "-c", code], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(
                f"{', '.join(imports)} does not import in {found.path} ({found.source}): "
                "run `make engines` and `make test-engines`"
            )
    return found.path


def _model() -> torch.nn.Module:
    return tiny_hf_model("llama", seed=0, **OVERRIDES).eval()


def _bf16_model() -> torch.nn.Module:
    """The eager model of a bf16 checkpoint: its bf16-rounded weights, computed in float32."""
    model = _model()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    return model


def _fake_quant(recipe: str) -> torch.nn.Module:
    model = _model()
    quantize(model, recipe)
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts whose eager greedy steps all have a top-2 margin above MIN_MARGIN.

    Safe for float32 and the quantized rows' tolerances; a bfloat16 comparison chooses
    its own (above twice its tolerance, see the bfloat16 test)."""
    return choose_prompts(_model(), min_margin=MIN_MARGIN)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(kind)``: the artifact of that kind, exported once per module."""
    root = tmp_path_factory.mktemp("served")
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind == "onnx":  # any float graph: the session's decoder (tests/test_onnx_api.py's)
            return shared_export(tmp_path_factory, "onnx", "decoder").path
        if kind not in made:
            made[kind] = _export(kind, root / kind.replace("/", "-"))
        return made[kind]

    return make


def _export(kind: str, out: Path) -> Path:
    model = _model()
    if kind == "fp32":
        return exportlm.export_model("hf_checkpoint", model, out)
    if kind == "bf16":
        return exportlm.export_model("hf_checkpoint", model, out, dtype="bfloat16")
    layout, recipe = kind.split("/")
    quantize(model, recipe)
    return exportlm.export_model("hf_checkpoint", model, out, format=layout)


def _passed(got: Served) -> float:
    assert got.outcome is Outcome.PASSED, got.message
    assert got.tokens_equal
    assert got.max_gap is not None
    assert got.atol is not None
    assert got.max_gap <= got.atol
    print(f"{got.engine} {got.engine_version} {got.kind}: {got.message}")
    return got.max_gap


def _same_version_as_the_table(got: Served) -> None:
    """A table row is about the version it was read from; another version is not checked."""
    if got.off_table:
        pytest.skip(
            f"{got.engine}'s table was read from {got.table_version}; found "
            f"{got.engine_version}: `make engines`"
        )


# The float32 plain checkpoint in vLLM and transformers, transformers on CT FP8 and
# OpenVINO on the plain ONNX are the plugin's `served` items (stage 2 of `make
# test-engines`: served[hf_checkpoint-vllm-llama-cpu], ...); here only what they do not run.
def test_vllm_serves_our_bfloat16_checkpoint(artifacts: Callable[..., Path]) -> None:
    """bf16 moves a logprob up to ~0.6 on some CPUs (benchmarks/engine_bf16_error.py), so
    the prompts are chosen by serve_and_compare above twice that tolerance; where no draw
    clears it, a greedy swap at a smaller eager margin is a near-tie, never a pass."""
    _python("vllm")
    got = serve_and_compare("vllm", artifacts("bf16"), _bf16_model(), dtype="bfloat16")
    assert got.engine_version == get_engine("vllm").table_version
    assert got.atol is not None
    assert got.max_gap is not None
    assert got.max_gap <= got.atol, got.message
    if got.outcome is Outcome.NEAR_TIE:
        assert got.diverges is not None
        print(f"vllm bf16: {got.message}")
        return
    _passed(got)


def test_transformers_misreads_a_modelopt_fp8_checkpoint_as_its_table_says(
    prompts: list[list[int]], artifacts: Callable[..., Path]
) -> None:
    _python("transformers")
    path = artifacts("modelopt/fp8")
    got = serve_and_compare("transformers", path, _fake_quant("fp8"), prompts=prompts)
    _same_version_as_the_table(got)
    assert got.outcome is Outcome.MISREADS, got.message
    assert got.max_gap is not None
    assert got.max_gap > 0.05, f"transformers now reads ModelOpt FP8: update its table ({got})"


#: (layout, recipe, the support-table scheme) of the checkpoints vLLM CPU does not serve
#: that the plugin's CPU `served` items do not send it (they send ModelOpt W8A16 and CT FP8).
NOT_SERVED = [
    ("modelopt", "int4_awq", "W4A16_AWQ"),
    ("modelopt", "fp8", "FP8"),
    ("modelopt", "nvfp4", "NVFP4"),
]


@pytest.mark.parametrize(("layout", "recipe", "scheme"), NOT_SERVED)
def test_vllm_cpu_does_what_its_table_says_with_our_quantized_checkpoints(
    layout: str, recipe: str, scheme: str, prompts: list[list[int]], artifacts: Callable[..., Path]
) -> None:
    _python("vllm")
    match = get_engine("vllm").support("hf_checkpoint", layout, scheme, device="cpu")
    assert match.verdict in (Verdict.REFUSED, Verdict.ENGINE_LIMIT)
    path = artifacts(f"{layout}/{recipe}")
    # bfloat16: vLLM's ModelOpt configs refuse float32 activations at config validation.
    got = serve_and_compare("vllm", path, _fake_quant(recipe), prompts=prompts, dtype="bfloat16")
    _same_version_as_the_table(got)
    print(f"vllm {layout} {scheme}: {got.outcome.value}: {got.engine_error}")
    # The comparison holds the engine's words against the table's message: another
    # message, or a load that now works, is a FAILED outcome naming both.
    assert got.declared, got.message
    assert got.outcome.value == match.verdict.value
    assert got.engine_error


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("fp32", ("hf_checkpoint", None, None, "float32")),
        ("bf16", ("hf_checkpoint", None, None, "bfloat16")),
        ("modelopt/int8_wo", ("hf_checkpoint", "modelopt", "W8A16", "float32")),
        ("modelopt/fp8", ("hf_checkpoint", "modelopt", "FP8", "float32")),
        ("compressed-tensors/fp8", ("hf_checkpoint", "compressed-tensors", "FP8", "float32")),
        ("onnx", ("onnx", "plain", None, "float32")),
    ],
)
def test_an_artifact_is_named_in_the_terms_of_the_support_tables(
    kind: str, expected: tuple[str | None, ...], artifacts: Callable[..., Path]
) -> None:
    found = artifact_kind(artifacts(kind))
    assert (found.target, found.layout, found.scheme, found.dtype) == expected
    engine = "openvino" if found.target == "onnx" else "vllm"
    match = get_engine(engine).support(found.target, found.layout, found.scheme, dtype=found.dtype)
    assert match.verdict is not Verdict.UNKNOWN
