"""The quantized conformance checks read the recipe registry (issue 43, item 2).

``roundtrip_quantized`` quantizes the toy model with every registered recipe, and the
exporter survey and ``quantized_generated`` with the same list: a recipe a plugin adds
(its ``exportlm.recipes`` entry point, as docs/architecture.md "How to add a recipe"
shows) is checked without a change to the plugin, and a recipe whose quantization
raises fails the item with the failure charged to that recipe, the others checked as
before. Each recipe is written in a layout its formats have (``w8a8`` and ``w4afp8``:
compressed-tensors; ``fp8_block``: ModelOpt's FP8_PB_WO), read off the record, not a name table.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from exportlm.models import tiny_hf_model
from exportlm.quant import quantize
from pytest_exportcheck.checks import CHECKS, ExporterCase
from pytest_exportcheck.checks._recipes import conformance_recipes, recipe_layout
from pytest_exportcheck.checks._registries import Registries
from pytest_exportcheck.checks._survey import survey_for
from pytest_exportcheck.checks.generated.quantized import generated_recipes
from pytest_exportcheck.run._cache import model_fingerprint
from tests._distinfo import make_distribution
from tests._installed import runpytest_installed

#: A third-party recipe, as the docs' worked example spells one: FP8 weights, no inputs.
PLUGIN_RECIPE = """
from exportlm.quant import QuantFormat, Recipe

FP8_WEIGHTS = Recipe("fp8_weights_plugin", QuantFormat.FP8)
"""

#: A recipe plugin whose format's kernels raise: its quantization (the calibration
#: forward that fake-quantizes the weights) raises, nothing else does.
BROKEN_RECIPE = """
import dataclasses

from exportlm.quant import QuantFormat, Recipe, register_recipe
from exportlm.quant.formats import get_format, register_format


def _boom(*args, **kwargs):
    raise RuntimeError("the boom8 kernel exploded")


_FP8 = get_format(QuantFormat.FP8)
register_format(
    dataclasses.replace(
        _FP8,
        format="boom8",
        quantize=_boom,
        dequantize=_boom,
        recipe=None,
        kv_cache=None,
        modelopt=dataclasses.replace(_FP8.modelopt, quant_algo="BOOM8"),
        compressed_tensors=None,
    )
)
register_recipe(Recipe("boom8", "boom8", _FP8.activations))
"""


def _run(pytester: pytest.Pytester, site: Path, *args: str) -> dict[str, Any]:
    runpytest_installed(
        pytester,
        site,
        "--export-targets=hf_checkpoint",
        "--export-checks=roundtrip_quantized",
        "--export-report=report.json",
        "-p",
        "no:cacheprovider",
        *args,
    )
    report = json.loads((pytester.path / "report.json").read_text())
    return {item["id"]: item for item in report["items"]}


def test_every_recipe_is_written_in_a_layout_its_formats_have() -> None:
    recipes = conformance_recipes(Registries.installed())
    # every built-in recipe, the KV-cache recipe with the weight recipe of its format
    builtins = ("fp8", "fp8_block", "fp8_dynamic", "int4_gptq", "mxfp4", "mxfp8", "w4a8_awq")
    for name in (*builtins, "w4afp8"):
        assert name in recipes
    assert "fp8+fp8_kv" in recipes
    assert "fp8_kv" not in recipes
    layouts = {name: recipe_layout(name) for name in recipes}
    assert layouts["fp8_block"] == "modelopt"  # FP8_PB_WO at its default block of 128
    assert layouts["w8a8"] == "compressed-tensors"
    assert layouts["w4a8_awq"] == "modelopt"  # its format has no compressed-tensors scheme
    assert layouts["w4afp8"] == "compressed-tensors"  # its format has no ModelOpt scheme
    assert layouts["fp8"] == layouts["int8_wo"] == layouts["fp8+fp8_kv"] == "modelopt"


def test_a_plugin_recipe_is_checked_without_touching_the_plugin(
    pytester: pytest.Pytester,
) -> None:
    site = pytester.path / "site"
    make_distribution(
        site,
        "exportlm-fp8-weights",
        {"exportlm.recipes": {"fp8_weights_plugin": "exportlm_fp8_weights:FP8_WEIGHTS"}},
        {"exportlm_fp8_weights.py": PLUGIN_RECIPE},
    )
    items = _run(pytester, site)
    item = items["roundtrip_quantized[hf_checkpoint-cpu]"]
    assert item["outcome"] == "pass", item["message"]
    assert "fp8_weights_plugin" in item["details"]["recipes"]
    assert "fp8_weights_plugin: max abs" in item["message"]
    # the built-in ones beside it, the compressed-tensors-only one in its layout
    assert {"fp8", "int8_wo", "w8a8", "fp8_block"} <= set(item["details"]["recipes"])


def test_a_recipe_that_raises_fails_the_item_charged_to_that_recipe_only(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(textwrap.dedent(BROKEN_RECIPE))
    items = _run(pytester, pytester.path / "no-site", "--export-quantize=fp8,boom8,int8_wo")
    item = items["roundtrip_quantized[hf_checkpoint-cpu]"]
    assert item["outcome"] == "fail"
    details = item["details"]
    assert details["recipe"] == "boom8"
    assert list(details["failed"]) == ["boom8"]
    assert "the boom8 kernel exploded" in details["failed"]["boom8"]
    assert "boom8" in item["message"]
    assert "exploded" in item["message"]
    assert set(details["recipes"]) == {"fp8", "int8_wo"}  # the others still checked, passed


def test_the_artifact_cache_tells_apart_recipes_with_equal_state_dicts() -> None:
    """``fp8_dynamic`` and ``int8_wo`` store the same per-row amaxes of the same weights:
    keyed on the state dict alone, the cache served one's artifact for the other, and
    ``roundtrip_quantized`` failed ``int8_wo`` on hf_checkpoint (max abs 0.049)."""
    fp8 = quantize(tiny_hf_model("llama", seed=0), "fp8_dynamic")
    int8 = quantize(tiny_hf_model("llama", seed=0), "int8_wo")
    fp8_state, int8_state = fp8.state_dict(), int8.state_dict()
    assert fp8_state.keys() == int8_state.keys()
    assert all(torch.equal(fp8_state[k], int8_state[k]) for k in fp8_state)  # the premise
    assert model_fingerprint(fp8) != model_fingerprint(int8)
    plain = tiny_hf_model("llama", seed=0)
    assert model_fingerprint(plain) == model_fingerprint(tiny_hf_model("llama", seed=0))


def test_a_block_format_on_small_experts_passes_moe_inputs(tmp_path: Path) -> None:
    """fp8_block's one 128x128 tile on a toy expert is a one-element ``weight_scale``;
    gate and up need not share it (they must for per-tensor FP8). Before moe_inputs read
    the format's granularity, the survey's fp8_block failed it for every MoE exporter."""
    case = ExporterCase("quant_moe_linear", tmp_path, options={"models": "iterable_moe"})
    result = CHECKS["moe_inputs"].fn(case)
    assert result.status == "pass", result.message
    surveyed = {q.recipe for q in survey_for(case).quantized}
    assert {"fp8", "fp8_block"} <= surveyed


@pytest.mark.parametrize("xdist", [(), ("-n", "1")], ids=["serial", "xdist"])
def test_export_quantize_narrows_the_exporter_survey(
    pytester: pytest.Pytester, xdist: tuple[str, ...]
) -> None:
    """The survey quantized the toy with every registered recipe whatever
    ``--export-quantize`` said: ``claims_all_quantized`` counted 14 models, not 1."""
    pytester.runpytest(
        "--export-exporters=quant_linear",
        "--export-models=llama",
        "--export-checks=claims_all_quantized",
        "--export-quantize=fp8",
        "--export-report=report.json",
        "-p",
        "no:cacheprovider",
        *xdist,
    )
    report = json.loads((pytester.path / "report.json").read_text())
    (item,) = [i for i in report["items"] if i["check"] == "claims_all_quantized"]
    assert item["outcome"] == "pass", item["message"]
    assert "in 1 quantized models" in item["message"], item["message"]


def test_export_quantize_narrows_quantized_generated(tmp_path: Path) -> None:
    chosen = ExporterCase("quant_linear", tmp_path, options={"quantize": ("fp8", "int8_wo")})
    assert generated_recipes(chosen) == ("fp8", "int8_wo")
    every = generated_recipes(ExporterCase("quant_linear", tmp_path))
    assert {"fp8", "int8_wo", "nvfp4", "fp8+fp8_kv"} <= set(every)
