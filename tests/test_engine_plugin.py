"""A third-party engine plugin is first-class: its record's tolerance is the one ``served`` uses.

The plugin (``tests/_engine_plugin.py``) is a distribution with an ``exportlm.engines``
entry point whose worker computes logits with transformers in its own process. Through
the pytest plugin (pytester, in-process runs), it passes ``served`` on the built-in
``hf_checkpoint`` artifact with no patching of the library, and fails it when its worker
drops the attention mask.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests._engine_plugin import BROKEN, ENGINE, make_broken_engine_plugin, make_engine_plugin
from tests._installed import installed, runpytest_installed

BASE = [
    "--export-only",
    "-p",
    "no:cacheprovider",
    "-n",
    "0",
    "--export-checks=served",
    "--export-targets=hf_checkpoint",
    "--export-models=llama",
    "-v",
    "-k",
    "toy",
]
ITEM = f"served[hf_checkpoint-{ENGINE}-llama-cpu]"


def test_its_worker_dropping_the_attention_mask_fails_served(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    plugin = make_engine_plugin(tmp_path / "site", drop_mask=True)
    result = runpytest_installed(pytester, plugin, *BASE, "-rf")
    result.stdout.re_match_lines(
        [rf".*{re.escape(ITEM)} FAILED", rf".*\[{ENGINE} / plain / failed\] .*logprob"]
    )
    result.assert_outcomes(failed=1)


#: A third-party target writing INT8 ONNX graphs (here: the built-in graph, declared so),
#: saying what its artifact is: an ONNX graph of scheme "int8".
INT8_TARGET = """
from exportlm.export import (
    EXPORT_REGISTRY, RUNTIME_REGISTRY, ensure_exporters_registered, export_target,
)

ensure_exporters_registered()
_ONNX = EXPORT_REGISTRY.get("onnx")


@export_target("int8_onnx", suffix=".onnx", artifact_kind="onnx", scheme="int8")
def int8_onnx(model, output_path, **kwargs):
    return _ONNX(model, output_path, **kwargs)


EXPORT_REGISTRY.register("int8_onnx", int8_onnx)
RUNTIME_REGISTRY.register("int8_onnx", RUNTIME_REGISTRY.get("onnx"))


def pytest_unconfigure(config):
    EXPORT_REGISTRY.unregister("int8_onnx")
    RUNTIME_REGISTRY.unregister("int8_onnx")
"""

#: The toy engine's ONNX rows: float graphs at 1e-4, INT8 QDQ graphs at their own 3e-4.
ONNX_ROWS = 'Support("onnx", "plain", evidence="measured"), Support("onnx", "plain", "int8", evidence="measured"),'
INT8_TOLERANCE = 'Tolerance(3e-4, "measured 1e-4 on INT8 QDQ graphs", "float32", "int8"),'


def test_an_int8_onnx_target_is_served_against_its_schemes_tolerance(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    from exportlm.engines import engines_taking

    plugin = make_engine_plugin(
        tmp_path / "site", extra_rows=ONNX_ROWS, extra_tolerances=INT8_TOLERANCE
    )
    pytester.makeconftest(INT8_TARGET)
    args = [*BASE, "--export-targets=int8_onnx", "--export-report=report.json"]
    result = runpytest_installed(pytester, plugin, *args)
    result.assert_outcomes(passed=1)
    report = json.loads((pytester.path / "report.json").read_text())
    item = next(i for i in report["items"] if i["id"] == f"served[int8_onnx-{ENGINE}-llama-cpu]")
    (row,) = item["details"]["served"]
    assert (row["target"], row["layout"], row["scheme"]) == ("onnx", "plain", "int8")
    assert row["atol"] == 3e-4  # the scheme's own, not the float graph's 1e-4
    # An engine whose table has no INT8 ONNX row does not serve it (no item at all).
    with installed(plugin):
        taking = engines_taking("onnx", "int8")
    assert ENGINE in taking
    assert "optimum-onnxruntime" not in taking
    assert "optimum-onnxruntime" in engines_taking("onnx")


def test_engines_formats_and_recipes_are_in_exportlm_list_and_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from exportlm.cli import main

    plugin = make_engine_plugin(tmp_path / "good")
    broken = make_broken_engine_plugin(tmp_path / "bad")
    with installed(plugin, broken):
        assert main(["list", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert main(["list"]) == 0
        table = capsys.readouterr().out
        assert main(["env", "--json"]) == 0
        env = json.loads(capsys.readouterr().out)
    engines = {e["name"]: e for e in listed["engines"]}
    assert {"vllm", "transformers", "openvino", ENGINE} <= set(engines)
    assert engines[ENGINE]["provider"].startswith("toy-engine")
    assert engines[ENGINE]["tolerances"][0]["atol"] == 1e-4
    assert engines[ENGINE]["tolerances"][0]["evidence"].startswith("measured")
    assert {"int4_awq", "w8a8", "fp8_kv"} <= {r["name"] for r in listed["recipes"]}
    assert "int8" in {f["name"] for f in listed["quant_formats"]}
    (failure,) = [f for f in listed["failed_plugins"] if f["registry"] == "engine"]
    assert failure["name"] == BROKEN
    assert "broken_engine needs libengine.so" in failure["error"]
    assert "Serving engines:" in table
    assert ENGINE in table
    assert ENGINE in env["registered"]["engines"]
    assert any("broken_engine needs libengine.so" in f for f in env["registered"]["failed_plugins"])


def test_a_third_party_engine_passes_served_and_a_broken_one_fails_only_plugin_loads(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """The toy engine, its tolerance on its record, passes ``served`` with no patching; a
    broken engine plugin's error is charged to it (header, report, its own
    ``plugin_loads`` item), not to the toy engine's ``served`` item, even where
    ``--export-engine`` names it."""
    import sys

    plugin = make_engine_plugin(tmp_path / "good")
    broken = make_broken_engine_plugin(tmp_path / "bad")
    args = [
        *BASE[:-2],
        "-k",
        "toy or broken",
        "--export-checks=served,plugin_loads",
        f"--export-engine={BROKEN}={sys.executable}",
        "--export-report=report.json",
    ]
    result = runpytest_installed(pytester, [plugin, broken], *args)
    result.stdout.re_match_lines(
        [
            rf"exportcheck engines: .*{ENGINE}",
            rf"exportcheck engine '{BROKEN}' from broken-engine-dist .*FAILED to load",
        ]
    )
    result.assert_outcomes(passed=1, failed=1)
    items = {i["id"]: i for i in json.loads((pytester.path / "report.json").read_text())["items"]}
    assert items[ITEM]["outcome"] == "pass"
    loads = items[f"plugin_loads[engine:{BROKEN}]"]
    assert loads["outcome"] == "fail"
    assert "broken_engine needs libengine.so" in loads["message"]
    report = json.loads((pytester.path / "report.json").read_text())
    plugins = {(p["kind"], p["name"]) for p in report["plugins"]}
    assert ("engine", ENGINE) in plugins
    assert [(f["kind"], f["name"]) for f in report["plugin_failures"]] == [("engine", BROKEN)]
