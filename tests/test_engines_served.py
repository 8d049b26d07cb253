"""Our artifacts served by the real engines, each in its own interpreter.

Each engine's interpreter comes from ``EXPORTLM_ENGINE_<NAME>`` (``make test-engines``
passes the venvs ``make engines`` builds) or from this interpreter where the engine
imports; otherwise the test skips and says to run ``make engines``.

The eager reference is the toy model itself (the fake-quantized model for a quantized
checkpoint), run in this process one unpadded row at a time. Prompts are chosen so that
the eager top-2 margin at every greedy step is well above what the stated tolerance
could swap (no near-ties); the engines get them as one left-padded batch.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import exportlm
from exportlm.engines import (
    EngineRefusedError,
    EngineRequest,
    EngineResult,
    Verdict,
    artifact_kind,
    find_interpreter,
    get_engine,
    run_engine,
)
from exportlm.models import tiny_hf_model
from exportlm.quant import quantize

NEW_TOKENS = 8
PROMPT_LENGTHS = (3, 7, 12)
#: Larger weights than the family default, so the toy's next-token distribution has
#: clear winners (default init: top-2 margins of 1e-3 that bf16 rounding can swap).
OVERRIDES = {"initializer_range": 0.3}

#: The smallest eager top-2 logit margin a prompt's greedy decoding may have: below it,
#: bf16 rounding (the loosest dtype here) could swap the top two tokens.
MIN_MARGIN = 0.2

#: Max |engine - eager| of a teacher-forced log-probability, per engine and dtype
#: (measured maxima are in docs/engines.md; these leave headroom).
LOGPROB_ATOL = {
    ("vllm", "float32"): 1e-4,
    # bf16 compute against float32 eager on the same bf16 weights: 0.161 measured at
    # this weight scale (8 mantissa bits on logits of magnitude ~10), tokens still equal.
    ("vllm", "bfloat16"): 0.25,
    ("transformers", "float32"): 1e-4,
    ("openvino", "float32"): 1e-4,
}


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


@dataclass(frozen=True)
class Eager:
    """The eager model's greedy tokens, teacher-forced log-probs and smallest top-2 margin."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    margin: float


@torch.no_grad()
def _eager(model: torch.nn.Module, prompts: list[list[int]]) -> Eager:
    tokens, logprobs, margin = [], [], float("inf")
    for prompt in prompts:
        ids = torch.tensor([prompt])
        lp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        logprobs.append([float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)])
        row = list(prompt)
        for _ in range(NEW_TOKENS):
            last = model(torch.tensor([row])).logits[0, -1].double()
            top = torch.topk(last, 2).values
            margin = min(margin, float(top[0] - top[1]))
            row.append(int(last.argmax()))
        tokens.append(row[len(prompt) :])
    return Eager(tokens, logprobs, margin)


def _prompts(model: torch.nn.Module, min_margin: float) -> list[list[int]]:
    """One prompt per length: the first seeded draw whose greedy decoding has no near-tie."""
    rng = np.random.default_rng(19)
    chosen = []
    for length in PROMPT_LENGTHS:
        for _ in range(100):
            prompt = rng.integers(3, 256, size=length).tolist()
            if _eager(model, [prompt]).margin > min_margin:
                chosen.append(prompt)
                break
        else:
            raise AssertionError(f"no prompt of length {length} without a near-tie")
    return chosen


def _model() -> torch.nn.Module:
    return tiny_hf_model("llama", seed=0, **OVERRIDES)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts(_model(), MIN_MARGIN)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(kind)``: the artifact of that kind, exported once per module."""
    root = tmp_path_factory.mktemp("served")
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
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
    if kind == "onnx":
        return exportlm.export_model("onnx", model, out.with_suffix(".onnx"))
    layout, recipe = kind.split("/")
    quantize(model, recipe)
    return exportlm.export_model("hf_checkpoint", model, out, format=layout)


def _serve(engine: str, path: Path, prompts: list[list[int]], dtype: str | None) -> EngineResult:
    request = EngineRequest.left_padded(prompts, max_new_tokens=NEW_TOKENS, dtype=dtype)
    return run_engine(engine, path, request)


def _assert_matches(result: EngineResult, eager: Eager, atol: float) -> float:
    """Tokens equal row by row, log-probs within ``atol``; returns the largest difference."""
    for row, (got, want) in enumerate(zip(result.tokens, eager.tokens)):
        diverge = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
        assert diverge is None, (
            f"{result.engine} {result.engine_version}: row {row} diverges at new token "
            f"{diverge}: {got} != eager {want}"
        )
    worst = max(
        (
            abs(g - w)
            for got, want in zip(result.logprobs, eager.logprobs)
            for g, w in zip(got, want)
        ),
        default=0.0,
    )
    assert worst <= atol, f"{result.engine} {result.engine_version}: logprobs {worst:.3g} off"
    return worst


def _bf16_model() -> torch.nn.Module:
    """The eager model of a bf16 checkpoint: its bf16-rounded weights, computed in float32."""
    model = _model()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_serves_our_plain_checkpoint(
    dtype: str, prompts: list[list[int]], artifacts: Callable[..., Path]
) -> None:
    _python("vllm")
    kind, eager_model = ("fp32", _model()) if dtype == "float32" else ("bf16", _bf16_model())
    result = _serve("vllm", artifacts(kind), prompts, dtype)
    assert result.engine_version == get_engine("vllm").table_version
    worst = _assert_matches(result, _eager(eager_model, prompts), LOGPROB_ATOL["vllm", dtype])
    print(f"vllm {dtype}: max |logprob diff| {worst:.3g}, seconds {result.seconds}")


def test_transformers_serves_our_plain_checkpoint(
    prompts: list[list[int]], artifacts: Callable[..., Path]
) -> None:
    _python("transformers")
    result = _serve("transformers", artifacts("fp32"), prompts, "float32")
    worst = _assert_matches(
        result, _eager(_model(), prompts), LOGPROB_ATOL["transformers", "float32"]
    )
    print(f"transformers fp32: max |logprob diff| {worst:.3g}")


def _same_version_as_the_table(version: str | None, engine: str) -> None:
    """A table row is about the version it was read from; another version is not checked."""
    table = get_engine(engine).table_version
    if version != table:
        pytest.skip(f"{engine}'s table was read from {table}; found {version}: `make engines`")


def _fake_quant(recipe: str) -> torch.nn.Module:
    model = _model()
    quantize(model, recipe)
    return model


def test_transformers_serves_our_compressed_tensors_fp8_checkpoint(
    prompts: list[list[int]], artifacts: Callable[..., Path]
) -> None:
    _python("transformers", "transformers", "compressed_tensors")
    assert (
        get_engine("transformers").support("hf_checkpoint", "compressed-tensors", "FP8").verdict
        is Verdict.RUNS
    )
    result = _serve("transformers", artifacts("compressed-tensors/fp8"), prompts, "float32")
    eager = _eager(_fake_quant("fp8"), prompts)
    worst = _assert_matches(result, eager, LOGPROB_ATOL["transformers", "float32"])
    print(f"transformers compressed-tensors FP8: max |logprob diff| {worst:.3g}")


def test_transformers_misreads_a_modelopt_fp8_checkpoint_as_its_table_says(
    prompts: list[list[int]], artifacts: Callable[..., Path]
) -> None:
    _python("transformers")
    match = get_engine("transformers").support("hf_checkpoint", "modelopt", "FP8")
    assert match.verdict is Verdict.MISREADS
    result = _serve("transformers", artifacts("modelopt/fp8"), prompts, "float32")
    _same_version_as_the_table(result.engine_version, "transformers")
    eager = _eager(_fake_quant("fp8"), prompts)
    worst = max(abs(g - w) for r, e in zip(result.logprobs, eager.logprobs) for g, w in zip(r, e))
    assert worst > 0.05, f"transformers now reads ModelOpt FP8 ({worst:.3g} off): update its table"


def test_openvino_serves_our_plain_onnx_with_its_stated_hints(
    prompts: list[list[int]], artifacts: Callable[..., Path]
) -> None:
    _python("openvino")
    match = get_engine("openvino").support("onnx", "plain")
    assert match.verdict is Verdict.RUNS
    assert match.row is not None
    request = EngineRequest.left_padded(prompts, max_new_tokens=NEW_TOKENS, options=match.row.hints)
    result = run_engine("openvino", artifacts("onnx"), request)
    worst = _assert_matches(result, _eager(_model(), prompts), LOGPROB_ATOL["openvino", "float32"])
    print(f"openvino plain ONNX: max |logprob diff| {worst:.3g}, notes {result.notes}")


#: (layout, recipe, the support-table scheme) of the checkpoints vLLM CPU does not serve.
NOT_SERVED = [
    ("modelopt", "int8_wo", "W8A16"),
    ("modelopt", "int4_awq", "W4A16_AWQ"),
    ("modelopt", "fp8", "FP8"),
    ("modelopt", "nvfp4", "NVFP4"),
    ("compressed-tensors", "fp8", "FP8"),
]


@pytest.mark.parametrize(("layout", "recipe", "scheme"), NOT_SERVED)
def test_vllm_cpu_does_what_its_table_says_with_our_quantized_checkpoints(
    layout: str, recipe: str, scheme: str, prompts: list[list[int]], artifacts: Callable[..., Path]
) -> None:
    _python("vllm")
    match = get_engine("vllm").support(
        "hf_checkpoint", layout, scheme, dtype="float32", device="cpu"
    )
    assert match.verdict in (Verdict.REFUSED, Verdict.ENGINE_LIMIT)
    assert match.row is not None
    refusal: EngineRefusedError | None = None
    try:
        served = _serve("vllm", artifacts(f"{layout}/{recipe}"), prompts, None)
    except EngineRefusedError as err:
        refusal = err
    if refusal is None:
        _same_version_as_the_table(served.engine_version, "vllm")
        pytest.fail(f"vllm served {layout} {scheme}, but its table says {match.verdict.value}")
    print(f"vllm {layout} {scheme}: {refusal.detail}")
    _same_version_as_the_table(refusal.version, "vllm")
    assert refusal.stage == "load"
    assert match.row.message in refusal.detail, (
        f"vllm {refusal.version} says something else now; update its table: {refusal.detail}"
    )


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
    verdict = (
        get_engine("vllm")
        .support(found.target, found.layout, found.scheme, dtype=found.dtype)
        .verdict
    )
    assert verdict is not Verdict.UNKNOWN or found.target == "onnx"
