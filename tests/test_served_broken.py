"""``served`` fails for broken targets, through the plugin (pytester, in-process runs).

* ``nomask_onnx``: the built-in ONNX export whose ``kv_cache=True`` graph takes no
  ``attention_mask`` (so a left-padded batch attends to its padding): Optimum drops the
  mask and generates other tokens for the padded rows.
* ``vllm_refused_ckpt``: the built-in checkpoint writer, then ``config.json`` names an
  architecture vLLM has no model for: vLLM refuses it, and the failure carries vLLM's
  own message.

Each needs its engine's interpreter (``EXPORTLM_ENGINE_<NAME>``, ``make test-engines``)
and skips cleanly without it. Each broken target runs once, under xdist (``-n 2 --dist
loadgroup``); ``-n 0`` runs of the same two items were dropped (they checked the same).
"""

from __future__ import annotations

import pytest

from exportlm.engines import find_interpreter

CONFTEST = """
import json
from pathlib import Path

from exportlm.export import (
    EXPORT_REGISTRY, RUNTIME_REGISTRY, ensure_exporters_registered, export_target,
)

ensure_exporters_registered()
_ONNX = EXPORT_REGISTRY.get("onnx")
_HF = EXPORT_REGISTRY.get("hf_checkpoint")


@export_target(
    "nomask_onnx", capabilities={"kv_cache"}, suffix=".onnx", artifact_kind="onnx", atol=1e-4, rtol=1e-4
)
def nomask_onnx(model, output_path, **kwargs):
    if kwargs.get("kv_cache"):
        kwargs["attention_mask"] = False  # the bug: the KV graph has no mask input
    return _ONNX(model, output_path, **kwargs)


@export_target(
    "vllm_refused_ckpt", artifact="directory", artifact_kind="hf_checkpoint", atol=1e-4, rtol=1e-4
)
def vllm_refused_ckpt(model, output_path, **kwargs):
    out = Path(_HF(model, output_path, **kwargs))
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLMWithAHat"]  # the bug: no such model class
    (out / "config.json").write_text(json.dumps(config))
    return out


EXPORT_REGISTRY.register("nomask_onnx", nomask_onnx)
RUNTIME_REGISTRY.register("nomask_onnx", RUNTIME_REGISTRY.get("onnx"))
EXPORT_REGISTRY.register("vllm_refused_ckpt", vllm_refused_ckpt)
RUNTIME_REGISTRY.register("vllm_refused_ckpt", RUNTIME_REGISTRY.get("hf_checkpoint"))


def pytest_unconfigure(config):
    for name in ("nomask_onnx", "vllm_refused_ckpt"):
        EXPORT_REGISTRY.unregister(name)
        RUNTIME_REGISTRY.unregister(name)
"""

#: Under xdist, as the plugin tests run (the -n 0 runs checked the same: one engine run each).
XDIST = ["-n", "2", "--dist", "loadgroup"]

#: Runs a real engine: selected by `make test-engines` (`-m engines`).
pytestmark = pytest.mark.engines


def _need(engine: str) -> None:
    found = find_interpreter(engine)
    if found.path is None:
        pytest.skip(f"{found.reason}. Run `make engines` (or `make test-engines`)")


def _run(
    pytester: pytest.Pytester, target: str, workers: list[str], engine: str | None = None
) -> pytest.RunResult:
    """The target's served items (only ``engine``'s, by its node id, when given)."""
    pytester.makeconftest(CONFTEST)
    item = [f"exportcheck::served[{target}-{engine}-llama-cpu]"] if engine else []
    args = [
        *item,
        f"--export-targets={target}",
        "--export-checks=served",
        "--export-models=llama",
        "--export-only",
        "-p",
        "no:cacheprovider",
        *workers,
    ]
    # in-process: tests/conftest.py keeps the modules a run imports (torch's operator
    # libraries among them), so a later ONNX export does not register them again
    return pytester.runpytest(*args)


def test_a_kv_graph_that_ignores_the_mask_fails_served_in_optimum(
    pytester: pytest.Pytester,
) -> None:
    _need("optimum-onnxruntime")
    result = _run(pytester, "nomask_onnx", XDIST, "optimum-onnxruntime")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*served[[]nomask_onnx-optimum-onnxruntime-llama-cpu[]]*",
            "*[[]optimum-onnxruntime / kv_cache / failed[]] optimum-onnxruntime 0.1.0: row * "
            "diverges at new token *",
        ]
    )


def test_a_checkpoint_layout_vllm_refuses_fails_served_with_vllms_message(
    pytester: pytest.Pytester,
) -> None:
    _need("vllm")
    result = _run(pytester, "vllm_refused_ckpt", XDIST, "vllm")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*served[[]vllm_refused_ckpt-vllm-llama-cpu[]]*",
            "*[[]vllm / plain / failed[]] vllm 0.32.0 EngineRefusedError serving *",
            "*LlamaForCausalLMWithAHat*",
        ]
    )


def test_a_missing_engine_skips_and_fails_under_require_engines(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No interpreter for any ONNX engine: a skip naming them; a failure when required."""
    for name in ("OPENVINO", "OPTIMUM_ONNXRUNTIME", "ONNXRUNTIME_GENAI"):
        monkeypatch.setenv(f"EXPORTLM_ENGINE_{name}", "")
    for engine in ("openvino", "optimum-onnxruntime", "onnxruntime-genai"):
        if find_interpreter(engine).path is not None:
            pytest.skip(f"{engine} imports in this interpreter")
    result = _run(pytester, "nomask_onnx", ["-n", "0", "-rs"])
    result.assert_outcomes(passed=1, skipped=3)  # one served item per ONNX engine
    result.stdout.fnmatch_lines(["*[[]openvino / unavailable[]] openvino does not import*"])
    required = _run(pytester, "nomask_onnx", ["-n", "0", "--export-require-engines"])
    required.assert_outcomes(passed=1, failed=3)
    required.stdout.fnmatch_lines(["*(--export-require-engines)*"])
